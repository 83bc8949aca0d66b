"""hpccomm's private communicators.

hpccomm works on one private duplicate of each user communicator, shared by
everything built on that communicator, so that its point-to-point traffic can
never match a user's receive.  The duplicate is created collectively, on the
first call that passed validation, in the same order on every rank.
"""
from __future__ import annotations

from typing import Dict

from mpi4py import MPI

_DUPS: Dict[int, MPI.Comm] = {}


def private_comm(comm: MPI.Comm) -> MPI.Comm:
    """The private duplicate of ``comm`` (collective on its first use)."""
    handle = comm.py2f()
    dup = _DUPS.get(handle)
    if dup is None or dup == MPI.COMM_NULL:
        dup = comm.Dup()
        dup.Set_name(f"hpccomm:{comm.Get_name()}")
        _DUPS[handle] = dup
    return dup


def ranks_on_node(comm: MPI.Comm) -> int:
    """How many ranks of ``comm`` share this rank's node
    (``MPI_COMM_TYPE_SHARED``).  Collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def spans_one_node(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` shares one node: then MPI moves
    messages through shared memory with the ranks' own cores.  Collective;
    the same answer on every rank."""
    return ranks_on_node(comm) == comm.Get_size()
