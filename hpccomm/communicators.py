"""hpccomm's private communicators.

hpccomm works on one private duplicate of each user communicator, shared by
everything built on that communicator, so that its point-to-point traffic can
never match a user's receive.  The duplicate is created collectively, on the
first call that passed validation, in the same order on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from mpi4py import MPI

from . import handles

_KEYVAL: Optional[int] = None


def _release_cache(comm: MPI.Comm, keyval: int, cache: Dict[Any, Any]) -> None:
    """``comm`` is being freed: release what was cached on it, newest first."""
    for value in reversed(list(cache.values())):
        if isinstance(value, MPI.Comm):
            if value != MPI.COMM_NULL:
                value.Free()
                handles.freed("comm")
        elif hasattr(value, "release"):
            value.release()
    cache.clear()


def comm_cache(comm: MPI.Comm) -> Dict[Any, Any]:
    """A dict that lives exactly as long as ``comm``: an MPI attribute whose
    delete callback MPI calls when the user frees ``comm``, which then frees
    the communicators stored in it and calls ``release()`` on its other
    values that have one.  (A cache by handle would outlive the communicator: MPICH reuses
    a freed communicator's handle for the next one.)  Not copied by
    ``Dup``."""
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_release_cache)
    cache = comm.Get_attr(_KEYVAL)
    if cache is None:
        cache = {}
        comm.Set_attr(_KEYVAL, cache)
    return cache


def private_comm(comm: MPI.Comm) -> MPI.Comm:
    """The private duplicate of ``comm`` (collective on its first use), freed
    when ``comm`` is."""
    cache = comm_cache(comm)
    dup = cache.get("private")
    if dup is None:
        dup = cache["private"] = comm.Dup()
        handles.made("comm")
        dup.Set_name(f"hpccomm:{comm.Get_name()}")
    return dup


def ranks_on_node(comm: MPI.Comm) -> int:
    """How many ranks of ``comm`` share this rank's node
    (``MPI_COMM_TYPE_SHARED``).  Collective on its first use for ``comm``,
    then kept on it: a communicator's ranks do not move."""
    cache = comm_cache(comm)
    count = cache.get("ranks_on_node")
    if count is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            count = cache["ranks_on_node"] = node.Get_size()
        finally:
            node.Free()
    return count


def spans_one_node(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` shares one node: then MPI moves
    messages through shared memory with the ranks' own cores.  Collective;
    the same answer on every rank."""
    return ranks_on_node(comm) == comm.Get_size()
