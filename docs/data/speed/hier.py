import time, numpy as np, hpccomm
from mpi4py import MPI
c = MPI.COMM_WORLD
x = np.random.default_rng(c.rank).standard_normal(16 << 20).astype(np.float32)
for alg, opts in [("twoshot", {}), ("hierarchical", {"nodes": (0, 0, 1, 1)})]:
    r = hpccomm.Allreducer(c, codec="onebit", algorithm=alg, check="first", **opts)
    out = np.empty_like(x)
    ts = []
    for i in range(6):
        c.Barrier(); t = time.perf_counter(); r(x, key="k", out=out); ts.append(time.perf_counter() - t)
    s = r.stats.last
    if c.rank == 0: print(alg, f"{np.median(ts[1:])*1e3:.1f} ms", f"enc {s.t_encode*1e3:.1f} comm {s.t_comm*1e3:.1f} dec {s.t_decode*1e3:.1f} total {s.t_total*1e3:.1f}")
