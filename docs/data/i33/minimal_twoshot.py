"""The floor of a small onebit twoshot call: the same kernels into preallocated
packets and the same three collectives (agreement allreduce, alltoall, allgather),
without the codecs' checks, at P ranks (n = 1024, one chunk per rank).

    mpiexec -n 2 python docs/data/i33/minimal_twoshot.py
"""
import time, numpy as np
from mpi4py import MPI
import hpccomm
from hpccomm.kernels import onebit as K
from hpccomm.codecs.onebit import packet_size
comm = MPI.COMM_WORLD.Dup(); P = comm.size; r = comm.rank
n = 1024; m = n // P; col = m
x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
e = np.zeros(n, np.float32); e_out = np.empty(n, np.float32)
ps = packet_size(m, col); H = 16
send = np.zeros(P * ps, np.uint8); recv = np.zeros(P * ps, np.uint8)
gsend = np.zeros(ps, np.uint8); grecv = np.zeros(P * ps, np.uint8)
def parts(buf, j):
    p = buf[j*ps:(j+1)*ps]
    return p[H:H+8].view(np.float32), p[H+8:].view(np.uint32)
sp = [parts(send, j) for j in range(P)]
rmeans = np.ndarray((P, 2), np.float32, buffer=recv, offset=H, strides=(ps, 4))
rwords = np.ndarray((P, (m+31)//32), np.uint32, buffer=recv, offset=H+8, strides=(ps, 4))
gm, gw = gsend[H:H+8].view(np.float32), gsend[H+8:].view(np.uint32)
gp = [parts(grecv, j) for j in range(P)]
out = np.empty(n, np.float32); eo = np.zeros(m, np.float32); eo2 = np.empty(m, np.float32)
flags = np.zeros(4, np.int64)
def call():
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    for j in range(P):
        K.onebit_encode_feedback(x[j*m:(j+1)*m], e[j*m:(j+1)*m], True, col, sp[j][0], sp[j][1], e_out[j*m:(j+1)*m])
    comm.Alltoall(send, recv)
    mine = out[r*m:(r+1)*m]
    K.onebit_decode_sum(rmeans, rwords, col, mine)
    K.onebit_owner_step(mine, eo, True, True, col, gm, gw, eo2, mine)
    comm.Allgather(gsend, grecv)
    for j in range(P):
        if j != r:
            K.onebit_decode(gp[j][1], gp[j][0], col, out[j*m:(j+1)*m], False)
for _ in range(100): call()
comm.Barrier()
ts = np.empty(3000)
for i in range(3000):
    t0 = time.perf_counter(); call(); ts[i] = time.perf_counter() - t0
x2 = np.empty_like(x)
ts2 = np.empty(3000)
for i in range(3000):
    t0 = time.perf_counter(); comm.Allreduce(x, x2); ts2[i] = time.perf_counter() - t0
if r == 0: print(f"minimal twoshot onebit {n}: {1e6*np.median(ts):.1f} us; MPI_Allreduce {1e6*np.median(ts2):.1f} us")
