"""Helpers shared by the MPI tests.

Rules every MPI test follows so that a failure can never hang the suite:
collectives first, assertions after; and any data a decision depends on is
gathered so that every rank decides alike.
"""
import hashlib

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()


def digest(arr) -> str:
    """A hash of an array's bytes, dtype and shape."""
    a = np.ascontiguousarray(arr)
    h = hashlib.sha256()
    h.update(str(a.dtype).encode())
    h.update(str(a.shape).encode())
    h.update(a.view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()


def same_on_all_ranks(arr, comm=COMM) -> bool:
    """True when every rank holds bit-identical ``arr`` (collective)."""
    return len(set(comm.allgather(digest(arr)))) == 1


def raise_everywhere(fn, comm=COMM):
    """Run ``fn`` (expected to raise) and return ``(type name, message)`` of
    what it raised, or ``(None, None)``; plus whether all ranks agree."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - we compare what every rank raised
        got = (type(exc).__name__, str(exc))
    else:
        got = (None, None)
    everyone = comm.allgather(got)
    return got, all(g == everyone[0] for g in everyone)


def rank_data(n, seed=0, dtype=np.float32, rank=RANK, integers=False):
    """Deterministic per-rank input: normal values, or small integers."""
    rng = np.random.default_rng([seed, rank, n])
    if integers:
        return rng.integers(-50, 51, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


#: the kinds of ``out`` a reducer call may get (:func:`input_and_out`)
OUT_MODES = ("new", "separate", "inplace", "overlapping")


def input_and_out(n, seed, out_mode):
    """``(x, out)`` of ``n`` elements of :func:`rank_data` for an ``out_mode``
    of :data:`OUT_MODES`: no ``out``, a separate array, ``x`` itself, or one
    that overlaps ``x`` (shifted by one element)."""
    base = rank_data(2 * n + 1, seed=seed)
    if out_mode == "overlapping":
        return base[:n], base[1:n + 1]
    x = base[:n].copy()
    return x, {"new": None, "separate": np.empty_like(x), "inplace": x}[out_mode]


def exact_sum(n, seed=0, integers=False, nranks=SIZE):
    """The float64 sum of :func:`rank_data` (float32) over all ranks, computed locally."""
    total = np.zeros(n, dtype=np.float64)
    for r in range(nranks):
        total += rank_data(n, seed, rank=r, integers=integers).astype(np.float64)
    return total


