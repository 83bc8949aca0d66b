"""Where a repeated dense call's time goes, layer by layer (a diagnostic: it
reaches into the reducer's lean path): raw ``MPI_Allreduce`` on the world and
the private communicator, ``allreduce_sum`` (the wait rule), the lean call
(checks, times and statistics), the reducer's dispatch, and the public call;
5 rounds of medians of 2000 calls, slowest rank.

    HPCCOMM_PROFILE=docs/data/auto/profile-shm-p2.json \\
        mpiexec -bind-to core -n 2 python docs/data/i33/dense_layers.py
"""
import time, numpy as np
from mpi4py import MPI
import hpccomm
from hpccomm.collectives.transport import allreduce_sum
comm = MPI.COMM_WORLD
r = hpccomm.Allreducer(comm, codec="onebit", algorithm="auto", check="first")
x = np.ones(1024, np.float32); out = np.empty_like(x)
for _ in range(300): r(x, key="k", out=out)
lean = r._lean["k"]; pc = r._comm
cases = {
  "world Allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
  "private Allreduce": lambda: pc.Allreduce(x, out, op=MPI.SUM),
  "private Allreduce no op": lambda: pc.Allreduce(x, out),
  "allreduce_sum": lambda: allreduce_sum(pc, x, out),
  "_lean_call": lambda: r._lean_call(lean, x, out),
  "_call": lambda: r._call(x, "k", out),
  "reducer()": lambda: r(x, key="k", out=out),
}
res = {k: [] for k in cases}
for rnd in range(5):
    for k, f in cases.items():
        for _ in range(200): f()
        comm.Barrier()
        ts = np.empty(2000)
        for i in range(2000):
            t = time.perf_counter(); f(); ts[i] = time.perf_counter() - t
        res[k].append(comm.allreduce(float(np.median(ts)), op=MPI.MAX) * 1e6)
if comm.rank == 0:
    for k, v in res.items():
        print(f"{k:28s} {np.median(v):6.2f} us  ({' '.join(f'{a:.2f}' for a in v)})")
