import timeit, numpy as np
from mpi4py import MPI
import hpccomm
from hpccomm import requests
from hpccomm.collectives.transport import allreduce_sum
comm = MPI.COMM_WORLD   # run: mpiexec -n 2 python dense_call_layers.py
n = 1024
x = np.ones(n, np.float32); out = np.empty_like(x)
r = hpccomm.Allreducer(comm, codec="onebit", algorithm="auto", check="first")
for _ in range(100): r(x, key="k")
lean = r._lean["k"]
pc = r._comm
import time
def t(stmt, g, number=50000):
    return min(timeit.repeat(stmt, globals=g, number=number, repeat=5)) / number * 1e9
g = dict(globals())
for stmt in ["r(x, key='k')", "r._call(x, 'k', None)", "r._lean_call(lean, x, None)",
             "comm.Allreduce(x, out)", "pc.Allreduce(x, out, op=MPI.SUM)", "allreduce_sum(pc, x, out)",
             "np.empty(lean.shape, lean.dtype)", "x.flags.c_contiguous", "requests.drain()",
             "time.perf_counter()", "r.stats.record_repeat(lean.template, 1e-6, 2e-6)",
             "r._states.move_to_end('k')", "r._lean.get('k')", "x.shape == lean.shape and x.dtype is lean.dtype"]:
    v = t(stmt, g)
    if comm.rank == 0: print(f"{v:8.0f} ns  {stmt}")
