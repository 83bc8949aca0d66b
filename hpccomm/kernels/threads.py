"""How many threads hpccomm's parallel kernels use.

Kernels with a parallel form split their work into tiles cut by the data
(whole columns, ...), never by the number of threads, and combine tiles only
through integer counts: they give the same bits for any thread count, and the
same as their one-thread form.

The count is ``HPCCOMM_THREADS`` when set, else what :func:`set_threads`
said, else -- once a reducer has looked at its node (:func:`fit_to_node`,
on its first call) -- the cores this process may run on divided by the ranks
sharing its node: ranks that fill the cores get one thread each, a rank alone
on a 64-core node gets 64.  Never more than numba's ``NUMBA_NUM_THREADS``.
Before that, 1.
"""
from __future__ import annotations

import os
from typing import Optional

import numba

_explicit: Optional[int] = None
_fitted = 1


def _cap(k: int) -> int:
    return max(1, min(int(k), numba.config.NUMBA_NUM_THREADS))


def get() -> int:
    """The thread count of the parallel kernels now."""
    env = os.environ.get("HPCCOMM_THREADS")
    if env:
        try:
            return _cap(int(env))
        except ValueError:
            pass
    return _cap(_explicit if _explicit is not None else _fitted)


def set_threads(k: Optional[int]) -> None:
    """Use ``k`` threads (None: back to the automatic count)."""
    global _explicit
    if k is not None and (isinstance(k, bool) or int(k) != k or k < 1):
        raise ValueError(f"threads must be a positive integer or None, not {k!r}")
    _explicit = None if k is None else int(k)


def fit_to_node(ranks_on_node: int) -> None:
    """Set the automatic count from the ranks that share this node."""
    global _fitted
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cores = os.cpu_count() or 1
    _fitted = max(1, cores // max(1, int(ranks_on_node)))


def use() -> int:
    """Set numba's thread count for the calling thread to :func:`get` and
    return it (call right before a parallel kernel)."""
    k = get()
    if numba.get_num_threads() != k:
        numba.set_num_threads(k)
    return k
