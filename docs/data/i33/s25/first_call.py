"""A process's first ``hpccomm.allreduce`` of one codec, as a user's script
meets it: ``mpiexec -n 2 python first_call.py CODEC``.  Prints on rank 0 the
import time, the first call's (its kernels compiled or loaded from numba's
cache) and the second's.  1M float32, N(0, 1) per rank."""
import sys
import time

t0 = time.perf_counter()
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpccomm  # noqa: E402

t1 = time.perf_counter()
codec = sys.argv[1]
comm = MPI.COMM_WORLD
x = np.random.default_rng(comm.rank).standard_normal(1 << 20).astype(np.float32)
hpccomm.allreduce(x, comm, codec=codec)
t2 = time.perf_counter()
hpccomm.allreduce(x, comm, codec=codec)
t3 = time.perf_counter()
if comm.rank == 0:
    print(f"{codec}: import {t1 - t0:.2f} s, first call {t2 - t1:.2f} s, "
          f"second {1e3 * (t3 - t2):.1f} ms")
