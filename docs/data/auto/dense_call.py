"""Per-call time of a repeated dense call through the reducer against raw
``MPI_Allreduce`` (the results' "auto on shared memory, P = 2, with the lean
dense path").

    HPCCOMM_PROFILE=docs/data/auto/profile-shm-p2.json \\
        mpiexec -n 2 python docs/data/auto/dense_call.py N CHECK [ALGORITHM] [CODEC]

N float32 elements; an Allreducer(CODEC, ALGORITHM, check=CHECK) called with a
key and ``out=`` in a loop: 300 warm-up calls, then the median of 3000, slowest
rank; raw ``MPI_Allreduce`` of the same buffers before and after it.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import hpccomm

comm = MPI.COMM_WORLD
n, check = int(sys.argv[1]), sys.argv[2]
algorithm = sys.argv[3] if len(sys.argv) > 3 else "auto"
codec = sys.argv[4] if len(sys.argv) > 4 else "onebit"
reducer = hpccomm.Allreducer(comm, codec=codec, algorithm=algorithm, check=check)
x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
out = np.empty_like(x)


def timed(f, calls=3000, warmup=300):
    for _ in range(warmup):
        f()
    comm.Barrier()
    ts = np.empty(calls)
    for i in range(calls):
        t = time.perf_counter()
        f()
        ts[i] = time.perf_counter() - t
    return comm.allreduce(float(np.median(ts)), op=MPI.MAX)


raw1 = timed(lambda: comm.Allreduce(x, out, op=MPI.SUM))
ours = timed(lambda: reducer(x, key="k", out=out))
raw2 = timed(lambda: comm.Allreduce(x, out, op=MPI.SUM))
if comm.rank == 0:
    choice = reducer.stats.last.extra.get("auto", algorithm)
    print(f"n={n} check={check} {algorithm}/{codec} ({choice}): MPI_Allreduce "
          f"{raw1 * 1e6:.1f}/{raw2 * 1e6:.1f} us, reducer {ours * 1e6:.1f} us, "
          f"ratio {min(raw1, raw2) / ours:.2f}")
