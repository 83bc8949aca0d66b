"""Byte-level exchanges of packets, with the counts-before-data protocol.

Packets are ``uint8`` arrays.  When their sizes are known on every rank in
advance (fixed-size codecs), pass them and no count exchange happens; otherwise
counts travel first (``MPI_Alltoall`` / ``MPI_Allgather`` of int64), then the
data (``MPI_Alltoallv`` / ``MPI_Allgatherv`` of bytes).

Byte accounting (added to a :class:`~hpccomm.stats.CallStats`): an all-to-all
counts what this rank sends to and receives from *other* ranks; an allgather
counts, for both directions, the bytes of the other ranks' blocks -- what each
rank forwards and receives in a ring or recursive-doubling allgather.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..stats import CallStats

_INT_MAX = 2 ** 31 - 1


def _displacements(counts: np.ndarray) -> np.ndarray:
    d = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=d[1:])
    return d


def _check_counts(counts: np.ndarray, what: str) -> None:
    if counts.size and (counts.max() > _INT_MAX or counts.sum() > _INT_MAX):
        raise OverflowError(f"{what}: {int(counts.sum())} bytes exceed MPI's int counts; "
                            "reduce the tensor in smaller buckets")


def alltoallv_bytes(comm: MPI.Comm, packets: Sequence[np.ndarray], call: CallStats,
                    recv_sizes: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """Send ``packets[j]`` to rank ``j``; return the packets received, by source."""
    size, rank = comm.Get_size(), comm.Get_rank()
    send_counts = np.array([p.size for p in packets], dtype=np.int64)
    with call.time("comm"):
        if recv_sizes is None:
            recv_counts = np.empty(size, dtype=np.int64)
            comm.Alltoall(send_counts, recv_counts)
            call.sent(8 * (size - 1))
            call.received(8 * (size - 1))
        else:
            recv_counts = np.asarray(recv_sizes, dtype=np.int64)
        _check_counts(send_counts, "alltoallv")
        _check_counts(recv_counts, "alltoallv")
        sendbuf = np.concatenate(packets) if len(packets) else np.empty(0, np.uint8)
        recvbuf = np.empty(int(recv_counts.sum()), dtype=np.uint8)
        sd, rd = _displacements(send_counts), _displacements(recv_counts)
        comm.Alltoallv([sendbuf, (send_counts.tolist(), sd.tolist()), MPI.BYTE],
                       [recvbuf, (recv_counts.tolist(), rd.tolist()), MPI.BYTE])
    call.sent(int(send_counts.sum() - send_counts[rank]))
    call.received(int(recv_counts.sum() - recv_counts[rank]))
    return [recvbuf[rd[j]:rd[j] + recv_counts[j]] for j in range(size)]


def allgatherv_bytes(comm: MPI.Comm, packet: np.ndarray, call: CallStats,
                     sizes: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """Every rank's ``packet`` to every rank; return them by source rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    with call.time("comm"):
        if sizes is None:
            counts = np.empty(size, dtype=np.int64)
            comm.Allgather(np.array([packet.size], dtype=np.int64), counts)
            call.sent(8 * (size - 1))
            call.received(8 * (size - 1))
        else:
            counts = np.asarray(sizes, dtype=np.int64)
            if counts[rank] != packet.size:
                raise ValueError(f"allgatherv: packet is {packet.size} bytes, expected "
                                 f"{int(counts[rank])}")
        _check_counts(counts, "allgatherv")
        displs = _displacements(counts)
        recvbuf = np.empty(int(counts.sum()), dtype=np.uint8)
        comm.Allgatherv([packet, MPI.BYTE],
                        [recvbuf, (counts.tolist(), displs.tolist()), MPI.BYTE])
    others = int(counts.sum() - counts[rank])
    call.sent(others)
    call.received(others)
    return [recvbuf[displs[j]:displs[j] + counts[j]] for j in range(size)]
