"""How far this VM's shared-memory MPI_Allreduce moves within one launch: a
1 MiB and a 64 KiB MPI_Allreduce (medians of 50 and 200, slowest rank)
probed every 3 s for 45 s, after nothing (``none``: hpccomm is not even
imported) or after the kernel measurements of a calibration (``kernels``).

    mpiexec -bind-to core -n 2 python docs/data/i33/model/drift/mpi_drift.py none|kernels
"""
import os, sys, time, numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
def med(fn, reps=50):
    fn()
    ts = np.empty(reps)
    for i in range(reps):
        world.Barrier(); t0 = time.perf_counter(); fn(); ts[i] = time.perf_counter() - t0
    s = np.empty_like(ts); world.Allreduce(ts, s, op=MPI.MAX); return np.median(s) * 1e6
n = 262144
x = np.ones(n, np.float32); y = np.empty_like(x)
x4 = np.ones(16384, np.float32); y4 = np.empty_like(x4)
T0 = time.time()
res = []
def probe(label):
    t = med(lambda: world.Allreduce(x, y, op=MPI.SUM))
    t4 = med(lambda: world.Allreduce(x4, y4, op=MPI.SUM), 200)
    res.append(t)
    if world.rank == 0: print(f"{time.time()-T0:6.1f}s {label:10s} 1MiB {t:5.0f} us  64KiB {t4:5.1f} us  threads {len(os.listdir('/proc/self/task'))}", flush=True)
probe("start")
stage = sys.argv[1]
if stage == "kernels":
    from hpccomm.bench import calibrate as C
    import hpccomm
    comm = world.Dup()
    for name in ["onebit", "topk", "terngrad"]:
        codec = hpccomm.get_codec(name)
        for n_ in C.KERNEL_SIZES["default"]:
            C.measure_kernels(comm, codec, n_, 5)
for i in range(15):
    time.sleep(3); probe(stage)
if world.rank == 0: print("median", np.median(res[1:]), "max", max(res[1:]))
