"""Per-call time of a small compressed allreduce (the results' "Per-call overhead").

    mpiexec -n 2 python docs/data/speed/per_call.py CODEC N [prof] [check=first]

An Allreducer(codec, algorithm="twoshot") called with key and out= in a loop:
300 warm-up calls, then the median of 3000, slowest rank; the phase split from
its stats; the raw mpi4py collectives of the same sizes; ``prof`` adds a
cProfile of rank 0.
"""
import cProfile
import io
import pstats
import sys
import time

import numpy as np
from mpi4py import MPI

import hpccomm

comm = MPI.COMM_WORLD
codec = sys.argv[1] if len(sys.argv) > 1 else "onebit"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
prof = "prof" in sys.argv[3:]
check = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("check=")), "always")
r = hpccomm.Allreducer(comm, codec=codec, algorithm="twoshot", check=check)
x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
out = np.empty_like(x)
for _ in range(300):
    r(x, key="k", out=out)
r.stats.reset()
comm.Barrier()
profiler = cProfile.Profile() if prof and comm.rank == 0 else None
if profiler:
    profiler.enable()
ts = []
for _ in range(3000):
    t = time.perf_counter()
    r(x, key="k", out=out)
    ts.append(time.perf_counter() - t)
if profiler:
    profiler.disable()
    s = io.StringIO()
    pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
st = r.stats
med = comm.allreduce(np.median(ts), op=MPI.MAX)
if comm.rank == 0:
    c = st.calls
    print(f"{codec} n={n} check={check} median per call {med * 1e6:.1f} us")
    print(f"per call (mean): encode {st.t_encode / c * 1e6:.1f} comm {st.t_comm / c * 1e6:.1f} "
          f"decode {st.t_decode / c * 1e6:.1f} total {st.t_total / c * 1e6:.1f} us")
a = np.zeros(4, np.int64)
sb = np.zeros(300, np.uint8)
rb = np.zeros(300, np.uint8)
P = comm.Get_size()
cnt, dsp = [150] * P, [150 * i for i in range(P)]


def timed(f, k=3000):
    comm.Barrier()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return comm.allreduce(np.median(ts), op=MPI.MAX) * 1e6


r1 = timed(lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX))
r2 = timed(lambda: comm.Alltoallv([sb, (cnt, dsp), MPI.BYTE], [rb, (cnt, dsp), MPI.BYTE]))
r3 = timed(lambda: comm.Allgatherv(sb[:150], [rb, (cnt, dsp), MPI.BYTE]))
if comm.rank == 0:
    print(f"raw MPI: allreduce 32 B {r1:.1f} alltoallv {r2:.1f} allgatherv {r3:.1f} us")
