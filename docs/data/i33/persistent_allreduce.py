"""Blocking ``MPI_Allreduce`` against MPI-4's persistent ``MPI_Allreduce_init``
(Start + Wait) on the same buffers: three alternating rounds of medians of 3000
calls after 300 warm-up calls, rank 0's times.

    mpiexec -bind-to core -n 2 python docs/data/i33/persistent_allreduce.py
"""
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
for n in (1024, 4096, 16384, 65536):
    x = np.ones(n, np.float32); r = np.empty_like(x)
    req = c.Allreduce_init(x, r)
    res = {}
    for rnd in range(3):
        for name in ("blocking", "persistent"):
            ts = np.empty(3000)
            for i in range(300):
                if name == "blocking": c.Allreduce(x, r)
                else: req.Start(); req.Wait()
            c.Barrier()
            for i in range(3000):
                t = time.perf_counter()
                if name == "blocking": c.Allreduce(x, r)
                else: req.Start(); req.Wait()
                ts[i] = time.perf_counter() - t
            res.setdefault(name, []).append(np.median(ts) * 1e6)
    req.Free()
    if c.rank == 0:
        print(f"{n * 4:>7} B  blocking {' '.join(f'{v:.2f}' for v in res['blocking'])} us"
              f"   persistent {' '.join(f'{v:.2f}' for v in res['persistent'])} us")
