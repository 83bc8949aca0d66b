"""How close a repeated dense call through a Python API can come to the bare
``MPI_Allreduce``: the reducer's call (``auto`` sending dense, ``check="first"``)
next to the least a call of the same signature can do -- look the key up,
compare shape and dtype, call ``Allreduce`` on a private communicator, count
the step; no validation of ``out``, no clocks, no statistics -- and the bare
call, each timed as ``bench allreduce --order interleaved`` times them
(a barrier, then one call of each case in turn, rotating; slowest rank per
iteration, median).

    mpiexec -n 2 -bind-to core python docs/data/i33/dense_floor.py [BYTES ...]
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import hpccomm

comm = MPI.COMM_WORLD
SUM = MPI.SUM
now = time.perf_counter


class Least:
    """The least a keyed call ``f(x, key, out=out)`` does before MPI."""

    def __init__(self, comm, x):
        self.comm = comm.Dup()
        self.keys = {"k": [x.shape, x.dtype, 0]}

    def __call__(self, x, key=None, *, out=None):
        entry = self.keys.get(key)
        if entry is not None and x.shape == entry[0] and x.dtype is entry[1]:
            self.comm.Allreduce(x, out, SUM)
            entry[2] += 1
            return out
        raise ValueError(key)


def measure(nbytes, iters):
    n = nbytes // 4
    x = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(np.float32)
    outs = [np.empty_like(x) for _ in range(3)]
    reducer = hpccomm.Allreducer(comm, codec="onebit", algorithm="auto", check="first")
    least = Least(comm, x)
    for _ in range(3):
        reducer(x, "k", out=outs[1])
    assert reducer.repeat_path("k") == "dense"
    cases = [lambda: comm.Allreduce(x, outs[0], op=SUM),
             lambda: reducer(x, "k", out=outs[1]),
             lambda: least(x, "k", out=outs[2])]
    for _ in range(max(20, iters // 10)):
        for f in cases:
            f()
    times = np.empty((len(cases), iters))
    for i in range(iters):
        for j in range(len(cases)):
            c = (i + j) % len(cases)
            comm.Barrier()
            t = now()
            cases[c]()
            times[c, i] = now() - t
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return np.median(slowest, axis=1)


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[1:]] or [4096, 16384, 65536, 262144]
    for nbytes in sizes:
        raw, ours, least = measure(nbytes, 2000 if nbytes <= 65536 else 500)
        if comm.rank == 0:
            print(f"{nbytes:>8} B: MPI_Allreduce {raw * 1e6:6.1f} us, reducer {ours * 1e6:6.1f} us "
                  f"({raw / ours:.2f}x), least call {least * 1e6:6.1f} us ({raw / least:.2f}x)",
                  flush=True)
