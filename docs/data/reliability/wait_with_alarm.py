"""What raising the same error on every rank would cost (docs/results/reliability.md).

    mpiexec -n P python docs/data/reliability/wait_with_alarm.py

1. Each transfer as hpccomm makes it (a blocking MPI call) against the same
   transfer posted non-blocking and waited with MPI_Waitany beside a wildcard
   receive (MPI_ANY_SOURCE) on a second communicator -- how every rank would
   have to wait to hear of an error on another rank.
2. A small compressed call (onebit, twoshot, with its agreement) against one
   more 8-byte MPI_Allreduce -- the closing check such a scheme needs after
   the last transfer.
Medians of 7 batches, microseconds per call, the slowest rank's.
"""
import time

import numpy as np
from mpi4py import MPI

import hpccomm

comm = MPI.COMM_WORLD.Dup()
alarm_comm = MPI.COMM_WORLD.Dup()
P, rank = comm.Get_size(), comm.Get_rank()
alarm_buf = np.zeros(64, np.uint8)
alarm = alarm_comm.Irecv(alarm_buf, MPI.ANY_SOURCE, 7)


def per_call(fn, reps):
    for _ in range(max(5, reps // 10)):
        fn()
    batches = []
    for _ in range(7):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        batches.append((time.perf_counter() - t) / reps)
    worst = np.empty(1)
    comm.Allreduce(np.array([np.median(batches)]), worst, op=MPI.MAX)
    return worst[0] * 1e6


if rank == 0:
    print(f"# {P} ranks, {MPI.Get_library_version().splitlines()[0]}")
    print(f"{'transfer':>22} {'bytes':>8} {'blocking':>10} {'Waitany+alarm':>14} {'ratio':>6}")
for nb in (8, 4096, 65536, 1 << 20):
    reps = 200 if nb < 100000 else 30
    x = np.ones(max(1, nb // 4), np.float32)
    y = np.empty_like(x)
    sb, rb = np.zeros(nb * P, np.uint8), np.empty(nb * P, np.uint8)
    cnt, dsp = [nb] * P, [i * nb for i in range(P)]
    cases = {
        "Allreduce": (lambda: comm.Allreduce(x, y),
                      lambda: MPI.Request.Waitany([comm.Iallreduce(x, y), alarm])),
        "Allgatherv": (lambda: comm.Allgatherv([sb[:nb], MPI.BYTE], [rb, (cnt, dsp), MPI.BYTE]),
                       lambda: MPI.Request.Waitany([comm.Iallgatherv(
                           [sb[:nb], MPI.BYTE], [rb, (cnt, dsp), MPI.BYTE]), alarm])),
        "Alltoallv": (lambda: comm.Alltoallv([sb, (cnt, dsp), MPI.BYTE], [rb, (cnt, dsp), MPI.BYTE]),
                      lambda: MPI.Request.Waitany([comm.Ialltoallv(
                          [sb, (cnt, dsp), MPI.BYTE], [rb, (cnt, dsp), MPI.BYTE]), alarm])),
    }
    for name, (blocking, alarmed) in cases.items():
        a, b = per_call(blocking, reps), per_call(alarmed, reps)
        if rank == 0:
            print(f"{name:>22} {nb:>8} {a:>10.1f} {b:>14.1f} {b / a:>6.1f}")
alarm.Cancel()
alarm.Wait()

if rank == 0:
    print(f"\n{'onebit/twoshot call':>22} {'elements':>8} {'call':>10} {'+1 allreduce':>14} {'ratio':>6}")
flag = np.zeros(1, np.int64)
for n in (1024, 16384, 262144):
    reducer = hpccomm.Allreducer(comm, codec="onebit")
    g = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    reps = 200 if n < 100000 else 40
    a = per_call(lambda: reducer(g, key="g"), reps)
    b = per_call(lambda: (reducer(g, key="g"), comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)),
                 reps)
    if rank == 0:
        print(f"{'':>22} {n:>8} {a:>10.1f} {b:>14.1f} {b / a:>6.2f}")
