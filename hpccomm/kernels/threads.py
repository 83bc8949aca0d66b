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
Before that, 1.  :func:`for_node` says which count a node of R ranks gives,
and by which of these rules.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numba

_explicit: Optional[int] = None
_fitted = 1


def _cap(k: int) -> int:
    return max(1, min(int(k), numba.config.NUMBA_NUM_THREADS))


def _wanted(fitted: int) -> Tuple[int, str]:
    """The count before numba's cap, and the rule that gave it
    (``"env"``, ``"set"`` or ``"node"``)."""
    env = os.environ.get("HPCCOMM_THREADS")
    if env:
        try:
            return int(env), "env"
        except ValueError:
            pass
    if _explicit is not None:
        return _explicit, "set"
    return fitted, "node"


def get() -> int:
    """The thread count of the parallel kernels now."""
    return _cap(_wanted(_fitted)[0])


def set_threads(k: Optional[int]) -> None:
    """Use ``k`` threads (None: back to the automatic count)."""
    global _explicit
    if k is not None and (isinstance(k, bool) or int(k) != k or k < 1):
        raise ValueError(f"threads must be a positive integer or None, not {k!r}")
    _explicit = None if k is None else int(k)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def _node_share(ranks_on_node: int) -> int:
    return max(1, _cores() // max(1, int(ranks_on_node)))


def fit_to_node(ranks_on_node: int) -> None:
    """Set the automatic count from the ranks that share this node."""
    global _fitted
    _fitted = _node_share(ranks_on_node)


def for_node(ranks_on_node: int) -> Tuple[int, str]:
    """``(count, reason)``: what :func:`get` gives once a reducer has fitted
    the count to a node of ``ranks_on_node`` ranks (nothing is set), and the
    rule that decided it."""
    wanted, rule = _wanted(_node_share(ranks_on_node))
    ranks = max(1, int(ranks_on_node))
    reason = {"env": f"HPCCOMM_THREADS={os.environ.get('HPCCOMM_THREADS')}",
              "set": f"set_threads({_explicit})",
              "node": f"{_cores()} cores / {ranks} rank{'s' if ranks > 1 else ''} on the node"
              }[rule]
    k = _cap(wanted)
    if k < wanted:
        reason += f", at most NUMBA_NUM_THREADS = {numba.config.NUMBA_NUM_THREADS}"
    return k, reason


def use() -> int:
    """Set numba's thread count for the calling thread to :func:`get` and
    return it (call right before a parallel kernel)."""
    k = get()
    if numba.get_num_threads() != k:
        numba.set_num_threads(k)
    return k
