"""Every MPI call that moves hpccomm's data.

A :class:`Transport` is bound to one of hpccomm's private communicators and to
the :class:`~hpccomm.stats.CallStats` of one call.  Algorithms never call MPI
themselves: they call these methods, which time the call (``call.t_comm``),
count its bytes by one formula per pattern, and carry messages of any size.

Patterns, blocking and non-blocking (``i``-prefixed: they return a
:class:`Request` whose ``wait()`` gives what the blocking form returns)::

    alltoallv / ialltoallv     packets[j] to rank j; the packets received, by source
    allgatherv / iallgatherv   every rank's packet to every rank, by source
    allreduce / iallreduce     elementwise SUM or MAX of a numeric array
    sendrecv                   one payload out, one in (pairwise exchanges)
    send / recv                a payload with its size first
    isend / irecv              a payload, the size read from the receive status
    reduce_bcast               a user-defined MPI.Op over one record, then a broadcast

Packets are ``uint8`` arrays.  Where the receiver cannot know the sizes
(``recv_sizes`` / ``sizes`` / ``recv_size`` not given), int64 counts travel
first: ``MPI_Alltoall`` / ``MPI_Allgather`` / ``MPI_Sendrecv`` / ``MPI_Send``.
The non-blocking forms exchange such counts *blocking*, before they post the
data: then every rank posts its collectives in the order it started them,
whatever order its requests are later waited in (MPI requires one order).

Byte accounting (``call.bytes_sent`` / ``bytes_recv``, per rank)
    alltoallv   counted: the bytes to and from *other* ranks (plus 8 (P - 1)
                each way for a count exchange);
    allgatherv  received: the other ranks' blocks (counted); sent: the same
                figure, what a ring allgather forwards with equal blocks
                (``modelled``);
    allreduce   ``modelled`` by :func:`allreduce_bytes`: recursive doubling,
                ``ceil(log2 P) b``, for ``b <= 2 KiB`` and the
                bandwidth-optimal ring / Rabenseifner ``2 (P - 1) / P b``
                above -- MPICH's default choice;
    sendrecv, send, recv, isend, irecv   counted: the payloads (plus 8 for a
                size message);
    reduce_bcast ``modelled``: a binomial tree (MPICH's shape), ``(children +
                [r != 0]) b`` each way.
Where any figure of a call is a model, ``call.modelled`` is set.

Large messages
    MPI-4 libraries take counts and displacements beyond ``2**31 - 1`` in
    their large-count routines (``MPI_Alltoallv_c`` ...), which mpi4py calls
    and which match the plain routines on other ranks: there (the default,
    ``count_limit=None``) every pattern is one plain call.  Below MPI-4, or
    with an explicit ``count_limit``, a count or displacement beyond it is
    carried by derived datatypes any MPI-3 library accepts: a struct of ``q``
    blocks of ``BLOCK`` bytes plus a remainder of ``r`` bytes (BigMPI's and
    mpi4py's ``pkl5`` construction), at absolute addresses from
    ``MPI.BOTTOM`` so that no displacement overflows.  Only a rank's own
    counts are known to it, and every rank must enter the same collective,
    so with a limit ``alltoallv`` always runs as ``MPI_Alltoallw`` (plain
    byte datatypes where the counts fit); ``allgatherv`` decides from the
    counts every rank holds.  An allreduce of more than ``count_limit``
    elements runs in pieces of at most that many.  Device buffers are passed
    to MPI whole (mpi4py carries their counts).
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import handles
from ..stats import CallStats

INT_MAX = 2 ** 31 - 1
#: the count limit of a library with MPI-4 large counts (none that matters)
UNLIMITED = 2 ** 62
NATIVE_LARGE_COUNTS = MPI.Get_version() >= (4, 0)
#: bytes per block of a large message's datatype
BLOCK = 1 << 30
#: MPICH's default switch from recursive doubling to Rabenseifner (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE)
ALLREDUCE_SHORT_BYTES = 2048

_OPS = {"sum": MPI.SUM, "max": MPI.MAX}


class _Waiting(threading.local):
    #: a class default, so that a thread that never set it reads None without
    #: the AttributeError that ``getattr(local, name, None)`` raises inside
    #: (~0.3 us: a tenth of a small dense call)
    interval: Optional[float] = None


_waiting = _Waiting()


def set_wait_interval(seconds: Optional[float]) -> None:
    """How this thread waits for its large transfers: ``None`` (default) in
    MPI's own blocking calls, which poll at full speed; a number of seconds:
    non-blocking calls tested at that interval, sleeping in between, so the
    core is free for other threads while the wire (a NIC, the kernel's TCP
    stack) moves the data.  The progress thread of non-blocking reductions
    waits this way (:mod:`hpccomm.requests`)."""
    _waiting.interval = seconds


def _interval() -> Optional[float]:
    return _waiting.interval


def wait_all(requests: List[MPI.Request]) -> None:
    """Complete ``requests`` the way this thread waits (:func:`set_wait_interval`)."""
    interval = _interval()
    if interval is None:
        MPI.Request.Waitall(requests)
        return
    while not MPI.Request.Testall(requests):
        time.sleep(interval)


def allreduce_bytes(nbytes: int, size: int) -> int:
    """Modelled bytes one rank sends (and receives) in an allreduce of
    ``nbytes``: ``ceil(log2 P) nbytes`` up to :data:`ALLREDUCE_SHORT_BYTES`,
    ``2 (P - 1) nbytes // P`` above."""
    if size <= 1 or nbytes == 0:
        return 0
    if nbytes <= ALLREDUCE_SHORT_BYTES:
        return (size - 1).bit_length() * nbytes
    return 2 * (size - 1) * nbytes // size


def allreduce_sum(comm: MPI.Comm, send, recv: np.ndarray) -> None:
    """One plain ``MPI_Allreduce`` (sum) of a host array of at most
    ``2**31 - 1`` elements, waited for the way this thread waits
    (:func:`set_wait_interval`): the reducer's repeated dense call of a key
    (``send`` may be ``MPI.IN_PLACE``; its bytes are :func:`allreduce_bytes`)."""
    if _interval() is None:
        comm.Allreduce(send, recv, op=MPI.SUM)
    else:
        wait_all([comm.Iallreduce(send, recv, op=MPI.SUM)])


def binomial_children(rank: int, size: int) -> int:
    """Children of ``rank`` in a binomial tree rooted at 0 (MPICH's shape)."""
    count, mask = 0, 1
    while mask < size:
        if rank & mask:
            break
        if rank + mask < size:
            count += 1
        mask <<= 1
    return count


def _prefix(counts: List[int]) -> List[int]:
    """Exclusive prefix sums of a list of ints."""
    return [0, *itertools.accumulate(counts[:-1])] if counts else []


def displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of ``counts`` (int64)."""
    d = np.zeros(len(counts), dtype=np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=d[1:])
    return d


class Received(list):
    """The packets of an all-to-all or allgather, by source rank: views of
    one receive ``buffer``.  ``stride`` is set when they are equally long
    and back to back (packet ``j`` then starts at byte ``j * stride``), so
    a consumer may read them as the rows of one 2-D view
    (:func:`hpccomm.codecs.base.payload_rows`); else it is None."""

    __slots__ = ("buffer", "stride")

    def __init__(self, buffer: np.ndarray, counts: List[int], displs: List[int]):
        super().__init__([buffer[d:d + c] for d, c in zip(displs, counts)])
        self.buffer = buffer
        c0 = counts[0] if counts else 0
        self.stride = c0 if c0 and counts.count(c0) == len(counts) else None


class Request:
    """A transfer in flight.  ``wait()`` completes it and returns what the
    blocking form returns (again on later calls); ``test()`` says whether it
    is complete, and finishes it when it is."""

    def __init__(self, call: CallStats, requests: List[MPI.Request],
                 finish: Callable[[], object] = lambda: None,
                 cleanup: Callable[[], None] = lambda: None):
        self._call = call
        self._requests = requests
        handles.made("request", len(requests))
        self._finish = finish
        self._cleanup = cleanup
        self._result = None
        self.done = False

    def _complete(self) -> None:
        handles.freed("request", len(self._requests))
        try:
            self._result = self._finish()
        finally:
            self._cleanup()
            self.done = True

    def test(self) -> bool:
        if self.done:
            return True
        with self._call.time("comm"):
            if not MPI.Request.Testall(self._requests):
                return False
            self._complete()
        return True

    def wait(self):
        if not self.done:
            with self._call.time("comm"):
                wait_all(self._requests)
                self._complete()
        return self._result


class _Types:
    """Derived datatypes of one call, freed together."""

    __slots__ = ("block", "_made")

    def __init__(self, block: int):
        self.block = block
        self._made: List[MPI.Datatype] = []

    def at(self, address: int, nbytes: int) -> MPI.Datatype:
        """``nbytes`` bytes at absolute ``address`` as one datatype."""
        q, r = divmod(int(nbytes), self.block)
        blk = MPI.BYTE.Create_contiguous(self.block)
        dtype = MPI.Datatype.Create_struct([q, r], [address, address + q * self.block],
                                           [blk, MPI.BYTE]).Commit()
        blk.Free()
        self._made.append(dtype)
        handles.made("datatype")
        return dtype

    def free(self) -> None:
        for dtype in self._made:
            dtype.Free()
        handles.freed("datatype", len(self._made))
        self._made.clear()


def _new_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _address(buf: np.ndarray) -> int:
    return MPI.Get_address(buf) if buf.size else 0


def _joined(packets: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """The one buffer ``packets`` are consecutive views of, or None."""
    if not packets or not isinstance(packets[0].base, np.ndarray):
        return None
    base = packets[0]
    addr = base.__array_interface__["data"][0]
    end = addr
    for p in packets:
        if p.__array_interface__["data"][0] != end or not p.flags.c_contiguous:
            return None
        end += p.nbytes
    total = end - addr
    root = base.base if isinstance(base.base, np.ndarray) else None
    if root is None or root.dtype != np.uint8 or root.ndim != 1:
        return None
    start = addr - root.__array_interface__["data"][0]
    if start < 0 or start + total > root.nbytes:
        return None
    return root[start:start + total]


class FixedExchange:
    """The all-to-all and the allgather of a call repeated with fixed packet
    sizes (``twoshot``'s plan of a key): counts, displacements, the send
    buffer and both receive buffers made once, the received packets views
    of them made once.  The MPI calls, timing and byte accounting are
    :class:`Transport`'s plain ones (``MPI_Alltoallv`` / ``MPI_Allgatherv``,
    non-blocking and waited for under :func:`set_wait_interval`), so a rank
    on this path and one on Transport's enter the same collectives; only
    where those apply (:meth:`fits`).  The received packets are valid until
    the next exchange.  The buffers stay as long as the plan: it is for
    small calls (:data:`hpccomm.collectives.twoshot.PLAN_BYTES`).

    The sizes may be capacities (slots): a shorter packet goes out at the
    start of its slot, the bytes after it as they are, and the receiver
    finds its end in its header."""

    def __init__(self, comm: MPI.Comm, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                 gather_sizes: Sequence[int]):
        self.comm = comm
        self.rank = r = comm.Get_rank()
        self.send_counts = [int(c) for c in send_sizes]
        self.recv_counts = [int(c) for c in recv_sizes]
        self.gather_counts = [int(c) for c in gather_sizes]
        # zeroed, made once: no byte of an earlier array can pass for a packet
        self.sendbuf = np.zeros(sum(self.send_counts), np.uint8)
        self._send_at = [(d, d + c) for d, c in zip(_prefix(self.send_counts), self.send_counts)]
        recvbuf = np.zeros(sum(self.recv_counts), np.uint8)
        gatherbuf = np.zeros(sum(self.gather_counts), np.uint8)
        rd, gd = _prefix(self.recv_counts), _prefix(self.gather_counts)
        self._a2a = ([self.sendbuf, (self.send_counts, _prefix(self.send_counts)), MPI.BYTE],
                     [recvbuf, (self.recv_counts, rd), MPI.BYTE])
        self._gather_recv = [gatherbuf, (self.gather_counts, gd), MPI.BYTE]
        self.received = Received(recvbuf, self.recv_counts, rd)
        self.gathered = Received(gatherbuf, self.gather_counts, gd)
        self._a2a_bytes = (sum(self.send_counts) - self.send_counts[r],
                           sum(self.recv_counts) - self.recv_counts[r])
        self._gather_bytes = sum(self.gather_counts) - self.gather_counts[r]
        #: this rank's allgather slot, for a packet shorter than it
        self._gather_slot = np.zeros(self.gather_counts[r], np.uint8)

    @staticmethod
    def fits() -> bool:
        """Whether :class:`Transport` makes plain calls here: with MPI-4 large
        counts (below them it runs every all-to-all as ``MPI_Alltoallw``)."""
        return NATIVE_LARGE_COUNTS

    def send_slots(self) -> List[np.ndarray]:
        """The send buffer's packet for every rank: views that a caller may
        write the packets into once, then send with :meth:`alltoallv`
        (``packets=None``)."""
        return [self.sendbuf[lo:hi] for lo, hi in self._send_at]

    def alltoallv(self, packets: Optional[Sequence[np.ndarray]], call: CallStats) -> "Received":
        """``packets[j]`` (of at most the fixed sizes) to rank ``j`` -- or,
        for None, what the :meth:`send_slots` hold; the packets received."""
        t0 = time.perf_counter()
        if packets is not None:
            for (lo, hi), p in zip(self._send_at, packets):
                if p.size > hi - lo:
                    raise ValueError(f"a packet of {p.size} bytes for a slot of {hi - lo}")
                self.sendbuf[lo:lo + p.size] = p
        if _interval() is None:
            self.comm.Alltoallv(*self._a2a)
        else:
            wait_all([self.comm.Ialltoallv(*self._a2a)])
        call.t_comm += time.perf_counter() - t0
        call.sent(self._a2a_bytes[0])
        call.received(self._a2a_bytes[1])
        return self.received

    def allgatherv(self, packet: np.ndarray, call: CallStats) -> "Received":
        """This rank's ``packet`` (of at most its fixed size) to every rank;
        every rank's, by source."""
        t0 = time.perf_counter()
        if packet.size != self.gather_counts[self.rank]:
            slot = self._gather_slot
            if packet.size > slot.size:
                raise ValueError(f"a packet of {packet.size} bytes for a slot of {slot.size}")
            slot[:packet.size] = packet
            packet = slot
        send = [packet, MPI.BYTE]
        if _interval() is None:
            self.comm.Allgatherv(send, self._gather_recv)
        else:
            wait_all([self.comm.Iallgatherv(send, self._gather_recv)])
        call.t_comm += time.perf_counter() - t0
        call.sent(self._gather_bytes)
        call.received(self._gather_bytes)
        call.modelled = True
        return self.gathered


class Transport:
    """The MPI calls of one collective call on ``comm`` (see the module
    docstring), accounted in ``call``.  ``count_limit`` is the largest count
    or displacement passed to MPI as a plain int: None for the library's own
    limit (none with MPI-4 large counts, else ``2**31 - 1``); tests lower it
    to exercise the derived-datatype path on small data.  It must be the same
    on every rank."""

    def __init__(self, comm: MPI.Comm, call: CallStats, *, count_limit: Optional[int] = None):
        self.comm = comm
        self.call = call
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if count_limit is None:
            count_limit = UNLIMITED if NATIVE_LARGE_COUNTS else INT_MAX
        self.count_limit = int(count_limit)
        #: whether messages beyond the limit need derived datatypes
        self.limited = self.count_limit < UNLIMITED
        self.block = min(BLOCK, max(1, self.count_limit // 2))

    # ------------------------------------------------------------ accounting
    def _count(self, sent: int, received: int) -> None:
        self.call.sent(sent)
        self.call.received(received)

    def _model(self, sent: int, received: int) -> None:
        self._count(sent, received)
        self.call.modelled = True

    def _large(self, counts: List[int], displs: List[int]) -> bool:
        """Whether a count or an end displacement passes the int limit."""
        return self.limited and (max(counts, default=0) > self.count_limit or
                                 max(map(int.__add__, counts, displs), default=0)
                                 > self.count_limit)

    # ------------------------------------------------------------ all-to-all
    def alltoallv(self, packets: Sequence[np.ndarray],
                  recv_sizes: Optional[Sequence[int]] = None,
                  in_place: bool = False,
                  recv_buffer: Optional[Callable[[int], np.ndarray]] = None) -> List[np.ndarray]:
        """Send ``packets[j]`` to rank ``j``; return the packets received, by source.

        ``in_place``: MPI reads the packets where they are (``MPI_Alltoallw``
        with a datatype at each packet's address) instead of from one buffer
        they are copied into first -- worth it for large packets.  It must be
        the same on every rank (decide it from numbers every rank shares).
        ``recv_buffer(nbytes)``: the uint8 host buffer to receive into
        (default a new one; the device path passes its pinned staging)."""
        return self._alltoallv(packets, recv_sizes, blocking=True, in_place=in_place,
                               recv_buffer=recv_buffer)

    def ialltoallv(self, packets: Sequence[np.ndarray],
                   recv_sizes: Optional[Sequence[int]] = None,
                   in_place: bool = False) -> Request:
        """Non-blocking :meth:`alltoallv`; ``packets`` must stay untouched until
        the request completes."""
        return self._alltoallv(packets, recv_sizes, blocking=False, in_place=in_place)

    def _alltoallv(self, packets, recv_sizes, blocking, in_place=False, recv_buffer=None):
        if blocking and _interval() is not None:
            return self._alltoallv(packets, recv_sizes, False, in_place, recv_buffer).wait()
        P, r, comm = self.size, self.rank, self.comm
        send_counts = [int(p.size) for p in packets]
        sendbuf = _joined(packets)
        if sendbuf is None and not in_place:
            sendbuf = np.concatenate(packets) if len(packets) else np.empty(0, np.uint8)
        types = _Types(self.block)
        with self.call.time("comm"):
            recv_counts = (self.alltoall_counts(send_counts) if recv_sizes is None
                           else [int(c) for c in recv_sizes])
            recvbuf = (recv_buffer or _new_bytes)(sum(recv_counts))
            sd, rd = _prefix(send_counts), _prefix(recv_counts)
            try:
                if in_place:   # every rank: the packets where they lie, no copy
                    st = [types.at(_address(p), p.size) if p.size else MPI.BYTE
                          for p in packets]
                    rb = _address(recvbuf)
                    rt = [types.at(rb + rd[j], recv_counts[j]) if recv_counts[j] else MPI.BYTE
                          for j in range(P)]
                    args = ([MPI.BOTTOM, ([int(c > 0) for c in send_counts], [0] * P), st],
                            [MPI.BOTTOM, ([int(c > 0) for c in recv_counts], [0] * P), rt])
                    reqs = comm.Alltoallw(*args) if blocking else [comm.Ialltoallw(*args)]
                elif not self.limited:
                    args = ([sendbuf, (send_counts, sd), MPI.BYTE],
                            [recvbuf, (recv_counts, rd), MPI.BYTE])
                    reqs = comm.Alltoallv(*args) if blocking else [comm.Ialltoallv(*args)]
                else:  # every rank calls Alltoallw: only the buffer description is local
                    if self._large(send_counts, sd) or self._large(recv_counts, rd):
                        sb, rb = _address(sendbuf), _address(recvbuf)
                        st = [types.at(sb + sd[j], send_counts[j]) for j in range(P)]
                        rt = [types.at(rb + rd[j], recv_counts[j]) for j in range(P)]
                        args = ([MPI.BOTTOM, ([1] * P, [0] * P), st],
                                [MPI.BOTTOM, ([1] * P, [0] * P), rt])
                    else:
                        args = ([sendbuf, (send_counts, sd), [MPI.BYTE] * P],
                                [recvbuf, (recv_counts, rd), [MPI.BYTE] * P])
                    reqs = comm.Alltoallw(*args) if blocking else [comm.Ialltoallw(*args)]
            except BaseException:
                types.free()
                raise

        def finish():
            self._count(sum(send_counts) - send_counts[r], sum(recv_counts) - recv_counts[r])
            return Received(recvbuf, recv_counts, rd)

        if not blocking:
            return Request(self.call, reqs, finish=finish, cleanup=types.free)
        types.free()
        return finish()

    # ------------------------------------------------------------ allgather
    def allgatherv(self, packet: np.ndarray,
                   sizes: Optional[Sequence[int]] = None,
                   recv_buffer: Optional[Callable[[int], np.ndarray]] = None) -> List[np.ndarray]:
        """Every rank's ``packet`` to every rank; return them by source rank
        (received into ``recv_buffer(nbytes)`` when given, as for
        :meth:`alltoallv`)."""
        return self._allgatherv(packet, sizes, blocking=True, recv_buffer=recv_buffer)

    def iallgatherv(self, packet: np.ndarray, sizes: Optional[Sequence[int]] = None) -> Request:
        """Non-blocking :meth:`allgatherv`."""
        return self._allgatherv(packet, sizes, blocking=False)

    def _allgatherv(self, packet, sizes, blocking, recv_buffer=None):
        if blocking and _interval() is not None:
            return self._allgatherv(packet, sizes, False, recv_buffer).wait()
        P, r, comm = self.size, self.rank, self.comm
        types = _Types(self.block)
        with self.call.time("comm"):
            counts = (self.allgather_counts(packet.size) if sizes is None
                      else [int(c) for c in sizes])
            if counts[r] != packet.size:
                raise ValueError(f"allgatherv: packet is {packet.size} bytes, expected "
                                 f"{counts[r]}")
            recvbuf = (recv_buffer or _new_bytes)(sum(counts))
            displs = _prefix(counts)
            try:
                if self._large(counts, displs):   # (the same decision on every rank)
                    mine = types.at(_address(packet), packet.size)
                    rb = _address(recvbuf)
                    rt = [types.at(rb + displs[j], counts[j]) for j in range(P)]
                    args = ([MPI.BOTTOM, ([1] * P, [0] * P), [mine] * P],
                            [MPI.BOTTOM, ([1] * P, [0] * P), rt])
                    reqs = comm.Alltoallw(*args) if blocking else [comm.Ialltoallw(*args)]
                else:
                    args = ([packet, MPI.BYTE], [recvbuf, (counts, displs), MPI.BYTE])
                    reqs = comm.Allgatherv(*args) if blocking else [comm.Iallgatherv(*args)]
            except BaseException:
                types.free()
                raise

        def finish():
            others = sum(counts) - counts[r]
            self._model(others, others)
            return Received(recvbuf, counts, displs)

        if not blocking:
            return Request(self.call, reqs, finish=finish, cleanup=types.free)
        types.free()
        return finish()

    # ------------------------------------------------------------ counts
    def alltoall_counts(self, send_counts: Sequence[int]) -> List[int]:
        """The byte counts the other ranks will send here, given ours to them
        (one ``MPI_Alltoall`` of int64)."""
        got = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(np.array(send_counts, dtype=np.int64), got)
        self._count(8 * (self.size - 1), 8 * (self.size - 1))
        return got.tolist()

    def allgather_counts(self, nbytes: int) -> List[int]:
        """Every rank's byte count (one ``MPI_Allgather`` of int64)."""
        got = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(np.array([nbytes], dtype=np.int64), got)
        self._count(8 * (self.size - 1), 8 * (self.size - 1))
        return got.tolist()

    # ------------------------------------------------------------ device memory
    # CUDA-aware MPI reads and writes device memory itself: the buffers here
    # are any objects mpi4py takes (``__cuda_array_interface__``), described
    # by plain counts and displacements -- no datatypes at host addresses.
    def _device_counts_fit(self, counts: List[int], displs: List[int]) -> None:
        if self._large(counts, displs):
            raise ValueError("a device-memory collective of more than 2**31 - 1 bytes needs "
                             "MPI-4 large counts; this MPI library has none")

    def alltoallv_device(self, sendbuf, send_counts: Sequence[int], send_displs: Sequence[int],
                         recvbuf, recv_counts: Sequence[int],
                         recv_displs: Sequence[int]) -> None:
        """``MPI_Alltoallv`` of bytes between device buffers: ``send_counts[j]``
        bytes at ``send_displs[j]`` of ``sendbuf`` to rank ``j``,
        ``recv_counts[j]`` from rank ``j`` to ``recv_displs[j]`` of ``recvbuf``."""
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        sd, rd = [int(d) for d in send_displs], [int(d) for d in recv_displs]
        self._device_counts_fit(send_counts, sd)
        self._device_counts_fit(recv_counts, rd)
        with self.call.time("comm"):
            self.comm.Alltoallv([sendbuf, (send_counts, sd), MPI.BYTE],
                                [recvbuf, (recv_counts, rd), MPI.BYTE])
        r = self.rank
        self._count(sum(send_counts) - send_counts[r], sum(recv_counts) - recv_counts[r])

    def allgatherv_device(self, sendbuf, recvbuf, counts: Sequence[int],
                          displs: Sequence[int]) -> None:
        """``MPI_Allgatherv`` of bytes between device buffers: rank ``j``'s
        ``counts[j]`` bytes to ``displs[j]`` of ``recvbuf``."""
        counts, displs = [int(c) for c in counts], [int(d) for d in displs]
        self._device_counts_fit(counts, displs)
        with self.call.time("comm"):
            self.comm.Allgatherv([sendbuf, counts[self.rank], MPI.BYTE],
                                 [recvbuf, (counts, displs), MPI.BYTE])
        others = sum(counts) - counts[self.rank]
        self._model(others, others)

    # ------------------------------------------------------------ objects
    def bcast_object(self, obj, root: int = 0):
        """Rank ``root``'s (small, picklable) ``obj`` on every rank; its pickled
        size is counted as sent by the root and received by the others."""
        import pickle

        with self.call.time("comm"):
            data = pickle.dumps(obj) if self.rank == root else None
            data = self.comm.bcast(data, root=root)
        if self.rank == root:
            self._model(len(data) * (self.size - 1), 0)
        else:
            self._model(0, len(data))
        return obj if self.rank == root else pickle.loads(data)

    # ------------------------------------------------------------ allreduce
    def allreduce(self, buf, out=None, op: str = "sum", nbytes: Optional[int] = None):
        """Elementwise ``op`` ("sum" or "max") of ``buf`` over the ranks, into
        ``out`` (in place when ``out`` is None); returns the result buffer.
        ``buf`` is a numpy array or a device array MPI can read (then pass
        ``nbytes`` for the accounting)."""
        if _interval() is not None:
            return self.iallreduce(buf, out, op, nbytes).wait()
        with self.call.time("comm"):
            for send, recv in self._pieces(buf, out):
                self.comm.Allreduce(send, recv, op=_OPS[op])
        self._account_allreduce(buf, nbytes)
        return buf if out is None else out

    def iallreduce(self, buf, out=None, op: str = "sum", nbytes: Optional[int] = None) -> Request:
        """Non-blocking :meth:`allreduce`."""
        with self.call.time("comm"):
            reqs = [self.comm.Iallreduce(send, recv, op=_OPS[op])
                    for send, recv in self._pieces(buf, out)]

        def finish():
            self._account_allreduce(buf, nbytes)
            return buf if out is None else out

        return Request(self.call, reqs, finish=finish)

    def _pieces(self, buf, out):
        """(send, recv) argument pairs: one, or pieces of ``count_limit`` elements."""
        if not isinstance(buf, np.ndarray) or buf.size <= self.count_limit:
            return [(MPI.IN_PLACE, buf) if out is None else (buf, out)]
        flat = buf.reshape(-1)
        dest = None if out is None else out.reshape(-1)
        step = self.count_limit
        return [(MPI.IN_PLACE, flat[i:i + step]) if dest is None
                else (flat[i:i + step], dest[i:i + step]) for i in range(0, flat.size, step)]

    def _account_allreduce(self, buf, nbytes):
        moved = allreduce_bytes(buf.nbytes if nbytes is None else int(nbytes), self.size)
        self._model(moved, moved)

    # ------------------------------------------------------------ point to point
    def _spec(self, buf: np.ndarray, types: _Types, nbytes: Optional[int] = None):
        """``buf`` (uint8) as an mpi4py message, through a derived datatype when large."""
        n = buf.size if nbytes is None else nbytes
        if n > self.count_limit:
            return [MPI.BOTTOM, 1, types.at(_address(buf), n)]
        return [buf, n, MPI.BYTE]

    def sendrecv(self, payload: np.ndarray, dest: int, source: int,
                 recv_size: Optional[int] = None, tag: int = 0) -> np.ndarray:
        """Send ``payload`` to ``dest`` and receive one from ``source``; without
        ``recv_size`` the sizes travel first (one int64 each way)."""
        types = _Types(self.block)
        with self.call.time("comm"):
            if recv_size is None:
                count = np.empty(1, dtype=np.int64)
                self.comm.Sendrecv(np.array([payload.size], dtype=np.int64), dest, tag,
                                   count, source, tag)
                self._count(8, 8)
                recv_size = int(count[0])
            buf = np.empty(recv_size, dtype=np.uint8)
            try:
                self.comm.Sendrecv(self._spec(payload, types), dest, tag,
                                   self._spec(buf, types), source, tag)
            finally:
                types.free()
        self._count(payload.size, recv_size)
        return buf

    def send(self, payload: np.ndarray, dest: int, tag: int) -> None:
        """Blocking send of ``payload`` (uint8) to ``dest``, its int64 size first."""
        types = _Types(self.block)
        with self.call.time("comm"):
            self.comm.Send(np.array([payload.size], dtype=np.int64), dest, tag)
            try:
                self.comm.Send(self._spec(payload, types), dest, tag)
            finally:
                types.free()
        self._count(8 + payload.size, 0)

    def recv(self, source: int, tag: int) -> np.ndarray:
        """Receive what :meth:`send` sent."""
        types = _Types(self.block)
        with self.call.time("comm"):
            count = np.empty(1, dtype=np.int64)
            self.comm.Recv(count, source, tag)
            buf = np.empty(int(count[0]), dtype=np.uint8)
            try:
                self.comm.Recv(self._spec(buf, types), source, tag)
            finally:
                types.free()
        self._count(0, 8 + buf.size)
        return buf

    def isend(self, payload: np.ndarray, dest: int, tag: int) -> Request:
        """Non-blocking send of ``payload`` (no size message: the receiver's
        :meth:`irecv` reads the size from its status)."""
        types = _Types(self.block)
        with self.call.time("comm"):
            req = self.comm.Isend(self._spec(payload, types), dest, tag)
        self._count(payload.size, 0)
        return Request(self.call, [req], cleanup=types.free)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        """Non-blocking receive into ``buf`` (uint8, at least as large as the
        message); ``wait()`` returns the view of ``buf`` that was filled."""
        types = _Types(self.block)
        status = MPI.Status()
        with self.call.time("comm"):
            req = self.comm.Irecv(self._spec(buf, types), source, tag)

        def finish():
            got = status.Get_elements(MPI.BYTE)
            self._count(0, got)
            return buf[:got]

        return _StatusRequest(self.call, req, status, finish, types.free)

    # ------------------------------------------------------------ reduce + broadcast
    def reduce_bcast(self, record: np.ndarray, merge: Callable, root: int = 0) -> np.ndarray:
        """``MPI_Reduce`` of one ``record`` (uint8) per rank with the user
        function ``merge(inbuf, inoutbuf, datatype)`` (commutative) to ``root``,
        then ``MPI_Bcast`` of the result from it; returns the result.  Every
        rank receives the root's bytes, so every rank holds the same bits."""
        nbytes = record.size
        result = np.empty_like(record)
        if nbytes <= self.count_limit:
            rtype = MPI.BYTE.Create_contiguous(nbytes).Commit()
            handles.made("datatype")
        else:  # blocks + remainder, relative to the record's start (counted by at())
            rtype = _Types(self.block).at(0, nbytes)
        op = MPI.Op.Create(merge, commute=True)
        handles.made("op")
        try:
            with self.call.time("comm"):
                self.comm.Reduce([record, 1, rtype], [result, 1, rtype], op=op, root=root)
                self.comm.Bcast([result, 1, rtype], root=root)
        finally:
            op.Free()
            rtype.Free()
            handles.freed("op")
            handles.freed("datatype")
        vrank = (self.rank - root) % self.size
        edges = binomial_children(vrank, self.size) + (vrank != 0)
        self._model(edges * nbytes, edges * nbytes)
        return result


class _StatusRequest(Request):
    """A single receive whose status the finish step reads."""

    def __init__(self, call, req, status, finish, cleanup):
        super().__init__(call, [req], finish=finish, cleanup=cleanup)
        self._status = status

    def test(self) -> bool:
        if self.done:
            return True
        with self._call.time("comm"):
            if not self._requests[0].Test(self._status):
                return False
            self._complete()
        return True

    def wait(self):
        if not self.done:
            with self._call.time("comm"):
                self._requests[0].Wait(self._status)
                self._complete()
        return self._result


__all__ = ["Transport", "Request", "allreduce_bytes", "binomial_children", "displacements",
           "INT_MAX", "UNLIMITED", "BLOCK"]

