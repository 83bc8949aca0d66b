"""The MPI objects hpccomm has made and not yet freed, by kind.

Every place in hpccomm that makes a communicator, a derived datatype, a
user-defined operation or a request counts it here, and counts it again when
it frees or completes it, so ``live()`` is what hpccomm holds of MPI's at any
moment -- what a leak would make grow.  MPICH offers no count of its own
(this build exports no MPI_T performance variables), and mpi4py's handles
are not tracked by Python's garbage collector, so nothing else could find a
handle that was dropped without being freed.  The soak benchmark
(``python -m hpccomm.bench soak``) reads it over 10^5 calls.
"""
from __future__ import annotations

import threading
from typing import Dict

KINDS = ("comm", "datatype", "op", "request")

_live: Dict[str, int] = dict.fromkeys(KINDS, 0)
_lock = threading.Lock()


def made(kind: str, count: int = 1) -> None:
    """``count`` objects of ``kind`` were made."""
    with _lock:
        _live[kind] += count


def freed(kind: str, count: int = 1) -> None:
    """``count`` objects of ``kind`` were freed (requests: completed)."""
    with _lock:
        _live[kind] -= count


def live() -> Dict[str, int]:
    """Objects made and not freed, by kind."""
    with _lock:
        return dict(_live)
