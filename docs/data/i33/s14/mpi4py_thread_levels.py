import sys, mpi4py
mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI
import numpy as np, time
comm = MPI.COMM_WORLD
x = np.ones(1024, np.float32); out = np.empty_like(x)
for _ in range(2000): comm.Allreduce(x, out)
best = 1e9
for b in range(15):
    comm.Barrier(); t = time.perf_counter()
    for _ in range(2000): comm.Allreduce(x, out)
    best = min(best, (time.perf_counter() - t) / 2000 * 1e6)
if comm.rank == 0: print(sys.argv[1], "mpi4py Allreduce 4KiB best %.2f us" % best, MPI.Query_thread())
