"""The shared-memory drift against each rank's own copy bandwidth, in one
launch: every ~0.3 s, the median of 20 bare 1 MiB ``MPI_Allreduce`` calls
(slowest rank) and of 5 copies of 16 MiB within each rank (slowest rank's
GB/s), until ``T`` seconds have passed, with the machine's CPU accounting
over each sample (/proc/stat, rank 0: CPUs' worth of steal, user and system
time).  Prints one line per sample, then the samples split at the midpoint
between the fast and slow modes of the 1 MiB call, with the copy bandwidth
of each half, and the steal time's correlation with the 1 MiB call.  (The
first recorded output, copy_vs_mpi.txt, predates the CPU columns.)

    mpiexec -bind-to core -n 2 python docs/data/i33/model/drift/copy_vs_mpi.py [T]

hpccomm is imported only for its timing helper (the calibration's, bench.harness)."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from hpccomm.bench.harness import slowest_median

T = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
comm = MPI.COMM_WORLD
x = np.ones(1 << 18, np.float32)             # 1 MiB
y = np.empty_like(x)
a = np.ones(4 << 20, np.float32)             # 16 MiB, beyond the caches
b = np.empty_like(a)
TICK = os.sysconf("SC_CLK_TCK")


def cpu():
    """The cumulative /proc/stat counters (seconds) and when they were read."""
    with open("/proc/stat", encoding="ascii") as f:
        return np.array([int(v) / TICK for v in f.readline().split()[1:9]]), time.perf_counter()


t00 = time.time()
samples = []
while comm.bcast(time.time() - t00 < T, root=0):    # rank 0 decides for all
    c0, p0 = cpu()
    t_ar = slowest_median(comm, lambda: comm.Allreduce(x, y, op=MPI.SUM), 20)
    t_copy = slowest_median(comm, lambda: np.copyto(b, a), 5)
    c1, p1 = cpu()
    used = (c1 - c0) / (p1 - p0)        # user nice system idle iowait irq softirq steal
    samples.append((time.time() - t00, t_ar, a.nbytes / t_copy / 1e9, used[7],
                    used[0] + used[1], used[2]))
    time.sleep(0.3)
if comm.rank == 0:
    print(f"# mpiexec -bind-to core -n {comm.size} python copy_vs_mpi.py {T:g}   "
          f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(t00))})")
    for t, t_ar, gbs, steal, user, system in samples:
        print(f"{t:6.1f}s  1MiB MPI_Allreduce {t_ar * 1e6:6.1f} us   16MiB copy {gbs:5.2f} GB/s   "
              f"steal {steal:4.2f}  user {user:4.2f}  system {system:4.2f} CPUs")
    ar = np.array([s[1] for s in samples])
    copy = np.array([s[2] for s in samples])
    cut = (ar.min() + ar.max()) / 2
    for name, sel in (("fast", ar < cut), ("slow", ar >= cut)):
        if sel.any():
            print(f"# {name} MPI ({sel.sum()} of {len(ar)} samples): 1 MiB median "
                  f"{np.median(ar[sel]) * 1e6:.0f} us, copy median {np.median(copy[sel]):.2f} GB/s")
    print(f"# correlation of the two: {np.corrcoef(ar, copy)[0, 1]:+.2f}")
    steal = np.array([s[3] for s in samples])
    print(f"# steal: {steal.mean():.3f} CPUs on average, above 0.05 in {(steal > 0.05).sum()} "
          f"samples ({(steal[ar >= cut] > 0.05).sum()} of them slow)"
          + (f"; its correlation with the 1 MiB call {np.corrcoef(ar, steal)[0, 1]:+.2f}"
             if steal.std() > 0 else ""))
