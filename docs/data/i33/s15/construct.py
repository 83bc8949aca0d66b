"""Cost of building an Allreducer (and of its first call's collectives),
with torch's libraries mapped as in a training process: best of 7 batches
of 200, microseconds each.

    mpiexec -n 2 python construct.py      (run from any directory; PYTHONPATH picks the tree)
"""
import time

import numpy as np
import torch  # noqa: F401  (maps ~hundreds of libraries, as a training process does)
from mpi4py import MPI

import hpccomm

comm = MPI.COMM_WORLD
x = np.ones(1024, np.float32)


def batch(first_call):
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(200):
        r = hpccomm.Allreducer(comm, codec="onebit", algorithm="twoshot")
        if first_call:
            r(x, key="k")
    return (time.perf_counter() - t) / 200 * 1e6


for label, first in (("Allreducer(...)", False), ("Allreducer(...) + first call", True)):
    best = min(batch(first) for _ in range(7))
    if comm.rank == 0:
        print(f"{best:9.1f} us  {label}  ({hpccomm.__file__})")
