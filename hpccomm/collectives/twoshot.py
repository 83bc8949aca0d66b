"""``twoshot``: compress, all-to-all, owner reduces and re-compresses, allgather.

The shape shared by 1-bit SGD's aggregator (CNTK), LBANN, DeepSpeed's
compressed allreduce and CGX:

1. Cut ``[0, n)`` into ``P`` chunks at multiples of the codec's alignment
   (:func:`~hpccomm.collectives.base.chunk_bounds`; e.g. whole columns for
   per-column codecs), the same on every rank.
2. Every rank adds its worker residual, ``v = x + e_w`` (the template's
   memory, :class:`~hpccomm.collectives.base.Contribution`), and encodes each chunk
   separately (chunk ``j`` encodes with ``offset`` = its start, so stochastic
   codecs draw the same numbers as a whole-vector encode would).
3. One ``MPI_Alltoallv`` sends chunk ``j`` to rank ``j`` (counts are exchanged
   first only when the codec's packet size depends on the data).
4. The owner of chunk ``r`` decodes and sums the ``P`` packets **in rank
   order** (its own included, decoded from its packet: the self chunk is
   quantized too), adds its owner residual ``w = acc + e_o``, re-encodes
   with :meth:`Codec.reencode` (as virtual rank ``P + r``, so its random stream differs from its worker
   encode) and keeps ``e_o = w - decode(packet)``.  A codec with
   ``owner_step`` does all of step 4 in one or two passes over the chunk,
   writing the owner's slice of ``out`` on the way (same bits).
5. One ``MPI_Allgatherv`` of the owner packets; every rank, the owner
   included, decodes all chunks from those bytes -- so every rank ends with
   the same bits.

Bytes per rank, for a codec with packet size ``C(m)`` for ``m`` elements:
``sum_{j != r} C(chunk_j)`` out in the all-to-all plus the other ranks' owner
packets in the allgather, about ``2 (P-1)/P * C(n)``.

Pipelining (option ``segments``).  With ``S > 1`` segments and a codec that
can cut its chunks (:meth:`~hpccomm.codecs.base.Codec.segment_unit` and
``owner_step``), every chunk is cut into ``S`` pieces at multiples of that
unit and steps 2-5 run per segment -- the ``s``-th piece of every chunk --
with non-blocking transfers: segment ``s + 1`` is encoded while segment
``s``'s all-to-all is on the wire, and segment ``s - 1`` is decoded after
segment ``s``'s owner step.  Owners, random streams and result bits are
those of ``S = 1``; every piece is a packet of its own (its header more on
the wire).  A codec whose pieces share a statistic of their whole chunk
(``chunk_statistic``: TernGrad's scale) runs in two phases instead: every
chunk's statistic first (one pass over the vector), then the all-to-all in
segments, the owner adding up each piece as it arrives; the owner's
statistic of its whole chunk; then the allgather in segments, each owner
piece re-encoded against that statistic while the one before is on the
wire.  Overlap needs something besides these cores to move the bytes
(a NIC, the kernel's TCP stack): within one node MPICH copies messages with
the ranks' own cores, and nothing overlaps (``docs/results/overlap.md``).  So
``segments="auto"`` is 1 when all ranks share a node, else one segment per
:data:`SEGMENT_ELEMENTS` elements, at most :data:`MAX_SEGMENTS`.  Segmented
calls keep the reducer's separate NaN/Inf scan (nothing may be sent before
every rank has checked its input, and the pipeline sends before the encode
is done).

Small packets of varying size (sparsifiers, Elias ``qsgd``) travel in slots
(:meth:`TwoShot._slot_exchange`): each at the start of a slot of the codec's
capacity for its chunk, its size in its header, where the slots of a call
take at most :data:`SLOT_BYTES` and no more than its float32 -- the fused
call then sends no counts first, and its transfers have fixed sizes.

Repeated small calls (:meth:`TwoShot.repeat_plan`).  A key whose call sent
fixed-size packets of at most :data:`PLAN_BYTES`, or slots, in one segment
keeps a :class:`TwoShotPlan`: the chunk plan, a transport and both
transfers' buffers, counts and MPI arguments, made once; its next calls run
the same steps 2-5 (:meth:`TwoShot._fused_exchange`) through them, with the
same collectives -- or, for a codec with kernels on laid-out packets
(onebit, fp16, bf16, terngrad, fixed-width qsgd, randk), only those kernels on
packets laid out when the plan is made; and for ``topk`` and ``dgc`` where
their selection is the exact top-k, ``threshold`` and ``adaptive``, their
slot kernels (:mod:`hpccomm.kernels.exact_topk`,
:mod:`hpccomm.kernels.threshold_slots`, :mod:`hpccomm.kernels.adaptive_slots`).
"""

import time
from dataclasses import replace
from typing import List, Optional, Tuple

import numpy as np

from ..codecs.base import HEADER_SIZE, Draw, EncodeContext
from ..communicators import spans_one_node
from ..errors import PacketError
from ..kernels.slots import BAD_PACKET
from ..stats import CallStats
from .base import (Algorithm, Contribution, ReduceContext, RepeatPlan, chunk_bounds,
                   input_error, register_algorithm)
from .transport import FixedExchange, Transport

#: elements per segment of ``segments="auto"`` across nodes (8 MiB of float32)
SEGMENT_ELEMENTS = 1 << 21
#: most segments of ``segments="auto"``
MAX_SEGMENTS = 16
#: packets of more bytes than this (all chunks together) go to MPI where they
#: lie rather than copied into one send buffer first
IN_PLACE_BYTES = 1 << 20
#: packets of at most this many bytes (all chunks together) get a plan for
#: their key's repeated calls: its buffers, about three times this, stay with
#: the key, and above it the per-call Python the plan saves is small next to
#: the kernels
PLAN_BYTES = 64 << 10
#: packets whose size varies travel in slots of their capacity where the
#: slots of a call take at most this many bytes (:meth:`TwoShot._slot_exchange`):
#: what a slot sends beyond its packet then costs about as much as the
#: exchange of counts it saves, two latencies, on a 1 Gbit/s link (8 KiB: 66 us)
SLOT_BYTES = 8 << 10


@register_algorithm
class TwoShot(Algorithm):
    name = "twoshot"

    fuses_feedback = True

    def __init__(self, comm, codec, segments="auto"):
        super().__init__(comm, codec)
        if segments != "auto" and (isinstance(segments, bool)
                                   or not isinstance(segments, (int, np.integer))
                                   or segments < 1):
            raise ValueError(f"twoshot: segments must be 'auto' or a positive integer, "
                             f"not {segments!r}")
        self.segments = segments if segments == "auto" else int(segments)
        #: whether all ranks share one node (asked on the first exchange)
        self._one_node: Optional[bool] = None

    def params(self):
        return {"segments": self.segments}

    def segment_count(self, n: int, shape: tuple, fused: bool = True) -> int:
        """How many segments a call of ``n`` elements runs in (1: not
        pipelined): the option, or the ``"auto"`` rule; 1 for codecs that
        cannot cut their chunks, for ``fused=False`` and for ``P = 1``."""
        codec = self.codec
        if (self.size == 1 or not fused or getattr(codec, "owner_step", None) is None
                or codec.segment_unit(shape) is None):
            return 1
        if self.segments != "auto":
            return self.segments
        if self._one_node is None or self._one_node:
            return 1
        return int(min(MAX_SEGMENTS, max(1, n // SEGMENT_ELEMENTS)))

    def checks_after_encode(self, n: int, shape: tuple) -> bool:
        return self.segment_count(n, shape) == 1

    def _plan(self, n, shape, state):
        """Chunk bounds, the fixed packet sizes (None when data-dependent) and
        this rank's receive sizes: computed once per (n, shape) and key."""
        key = ("twoshot", n, tuple(shape))
        plan = state.cache.get(key)
        if plan is None:
            codec, P, r = self.codec, self.size, self.rank
            bounds = [int(b) for b in chunk_bounds(n, P, codec.align(shape))]
            fixed = [codec.wire_size_for(bounds[j + 1] - bounds[j], shape) for j in range(P)]
            fixed = None if None in fixed else fixed
            plan = state.cache[key] = (bounds, fixed, [fixed[r]] * P if fixed else None)
        return plan

    def _slot_exchange(self, comm, n, shape, state) -> Optional[FixedExchange]:
        """For a codec whose packets vary in size, the transfers of a call
        of ``n`` elements in slots: every chunk's packet in a slot of the
        codec's capacity for it (:meth:`~hpccomm.codecs.base.Codec.capacity_for`),
        so that no counts travel first, where the slots together take at
        most :data:`SLOT_BYTES` and no more than the call's float32 (a slot
        holds the codec's worst case, and a compressed call should not send
        more than the plain one); made once per key.  None otherwise: fixed
        sizes, larger slots, no bound, or a library whose transport
        :class:`FixedExchange` does not match."""
        key = ("twoshot-slots", n, tuple(shape))
        exchange = state.cache.get(key, False)
        if exchange is False or (exchange is not None and exchange.comm is not comm):
            exchange = None
            bounds, fixed, _ = self._plan(n, shape, state)
            if fixed is None and FixedExchange.fits():
                slots = [self.codec.capacity_for(hi - lo, shape)
                         for lo, hi in zip(bounds[:-1], bounds[1:])]
                if None not in slots and sum(slots) <= min(SLOT_BYTES, 4 * n):
                    exchange = FixedExchange(comm, slots, [slots[self.rank]] * self.size, slots)
            state.cache[key] = exchange
        return exchange

    def _fixed_transfers(self, exchange: FixedExchange, call, bounds, slotted: bool):
        """``(alltoallv(packets), allgatherv(packet))`` through ``exchange``,
        accounted in ``call``; for slots (``slotted``), the packets received
        are cut from their slots (:meth:`~hpccomm.codecs.base.Codec.packet_in_slot`)."""
        if not slotted:
            return (lambda packets: exchange.alltoallv(packets, call),
                    lambda packet: exchange.allgatherv(packet, call))
        in_slot = self.codec.packet_in_slot
        m = bounds[self.rank + 1] - bounds[self.rank]
        sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        return (lambda packets: [in_slot(slot, m) for slot in exchange.alltoallv(packets, call)],
                lambda packet: [in_slot(slot, size) for slot, size
                                in zip(exchange.allgatherv(packet, call), sizes)])

    def chunk_plan(self, n: int, shape: tuple, state) -> Tuple[List[int], Optional[List[int]]]:
        """Step 1's chunk bounds (``P + 1``) and the chunks' fixed packet sizes
        (None when they depend on the data), as every call of ``(n, shape)``
        under this key uses them."""
        bounds, fixed, _ = self._plan(n, shape, state)
        return bounds, fixed

    def _segment_plan(self, n, shape, S, state) -> List[Tuple[List[Tuple[int, int]],
                                                            Optional[List[int]]]]:
        """Per segment: the piece ``(lo, hi)`` of every chunk and the pieces'
        fixed packet sizes (None when data-dependent).  Chunk ``j`` is cut at
        multiples of the codec's segment unit counted from its start."""
        key = ("twoshot-segments", n, tuple(shape), S)
        plan = state.cache.get(key)
        if plan is None:
            codec, P = self.codec, self.size
            bounds = self._plan(n, shape, state)[0]
            unit = codec.segment_unit(shape)
            cuts = [[bounds[j] + int(c) for c in chunk_bounds(bounds[j + 1] - bounds[j], S, unit)]
                    for j in range(P)]
            plan = []
            for s in range(S):
                pieces = [(cuts[j][s], cuts[j][s + 1]) for j in range(P)]
                sizes = [codec.wire_size_for(hi - lo, shape) for lo, hi in pieces]
                plan.append((pieces, None if None in sizes else sizes))
            state.cache[key] = plan
        return plan

    def exchange(self, work, out, state, ctx):
        codec, net, call, P, r = self.codec, ctx.net, ctx.call, self.size, self.rank
        n = work.x.size
        if self._one_node is None and P > 1:
            self._one_node = spans_one_node(net.comm)
        if P == 1:  # no communication: the codec round trip
            with call.time("encode"):
                packet, = work.encode_chunks([0, n], ctx, r)
            with call.time("decode"):
                codec.decode(packet, out)
            work.decoded(0, n, out)
            return
        # a check deferred to the encode (decided before the first call knew
        # the node layout) needs the whole encode before any transfer
        S = 1 if ctx.agree is not None else self.segment_count(n, ctx.shape, ctx.fused)
        owner = ctx.memory.owner
        fused_owner = (ctx.fused and getattr(codec, "owner_step", None) is not None
                       and (owner.fusable or not owner.enabled))
        if S > 1 and fused_owner:
            call.extra["segments"] = S
            if codec.chunk_statistic:
                self._pipelined_in_two_phases(work, out, state, ctx, S)
            else:
                self._pipelined(work, out, state, ctx, S)
            return
        bounds, fixed, recv_sizes = self._plan(n, ctx.shape, state)
        in_place = fixed is not None and sum(fixed) > IN_PLACE_BYTES
        slots = fused_owner and self._slot_exchange(net.comm, n, ctx.shape, state)
        if slots:
            self._fused_exchange(work, out, state, ctx, bounds,
                                 *self._fixed_transfers(slots, call, bounds, True))
            return
        if fused_owner:
            self._fused_exchange(
                work, out, state, ctx, bounds,
                lambda packets: net.alltoallv(packets, recv_sizes, in_place=in_place),
                lambda packet: net.allgatherv(packet, fixed))
            return
        with call.time("encode"):
            packets = work.encode_chunks(bounds, ctx, r)
        received = net.alltoallv(packets, recv_sizes, in_place=in_place)
        lo, hi = bounds[r], bounds[r + 1]
        with call.time("decode"):
            acc = self.scratch("acc", hi - lo)
            acc[:] = 0
            for src in range(P):  # rank order: the same sum on every owner
                codec.decode_add(received[src], acc)
        w = owner.compensate(state, "owner", acc)
        octx = ctx.encode_context(P + r, lo)
        if owner.enabled:   # the owner's fresh part: the sum it received
            octx = replace(octx, fresh=acc)
        with call.time("encode"):
            owner_packet = codec.reencode(w, octx)
        gathered = net.allgatherv(owner_packet, fixed)
        with call.time("decode"):
            for j in range(P):
                codec.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
        owner.update(state, "owner", w, out[lo:hi])

    def _fused_exchange(self, work, out, state, ctx, bounds, alltoallv, allgatherv):
        """Steps 2-5 in one segment with the codec's owner step;
        ``alltoallv(packets)`` and ``allgatherv(packet)`` move the bytes (the
        call's :class:`~hpccomm.collectives.transport.Transport`, or a
        repeated call's :class:`~hpccomm.collectives.transport.FixedExchange`)."""
        codec, call, P, r = self.codec, ctx.call, self.size, self.rank
        with call.time("encode"):
            packets = work.encode_chunks(bounds, ctx, r)
        received = alltoallv(packets)
        lo, hi = bounds[r], bounds[r + 1]
        owner = ctx.memory.owner
        e, e_out = self._owner_buffers(owner, state, hi - lo)
        owner_packet = self._fused_owner(received, out, lo, hi, e, e_out, ctx)
        gathered = allgatherv(owner_packet)
        with call.time("decode"):
            for j in range(P):
                if j != r:  # the own chunk was written by the owner step
                    codec.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
        if owner.enabled:
            owner.commit_fused(state, "owner")

    def repeat_plan(self, comm, n, shape, state, memory, deferred):
        """A :class:`TwoShotPlan` where the general path sends fixed-size
        packets, or slots (:meth:`_slot_exchange`), of at most
        :data:`PLAN_BYTES` in one segment through the codec's owner step,
        without derived datatypes; else None."""
        codec = self.codec
        owner = memory.owner
        if (self.size == 1 or getattr(codec, "owner_step", None) is None
                or not (owner.fusable or not owner.enabled)
                or (not deferred and self.segment_count(n, shape) != 1)
                or not FixedExchange.fits()):
            return None
        bounds, fixed, recv_sizes = self._plan(n, shape, state)
        if fixed is None:
            slots = self._slot_exchange(comm, n, shape, state)
            return None if slots is None else TwoShotPlan(self, bounds, slots, shape, memory,
                                                          slotted=True)
        if sum(fixed) > PLAN_BYTES:
            return None
        return TwoShotPlan(self, bounds, FixedExchange(comm, fixed, recv_sizes, fixed), shape,
                           memory)

    def _pipelined(self, work, out, state, ctx, S):
        """Steps 2-5 in ``S`` segments with non-blocking transfers (see the
        module docstring): encode ``s + 1`` while ``s`` is on the wire, owner
        step ``s``, decode ``s - 1`` after it."""
        r = self.rank
        plan = self._segment_plan(work.x.size, ctx.shape, S, state)
        bounds = self._plan(work.x.size, ctx.shape, state)[0]
        owner = ctx.memory.owner
        e, e_out = self._owner_buffers(owner, state, bounds[r + 1] - bounds[r])
        base = bounds[r]

        def owner_step(s, received):
            lo, hi = plan[s][0][r]
            sl = slice(lo - base, hi - base)
            return self._fused_owner(received, out, lo, hi, None if e is None else e[sl],
                                     None if e_out is None else e_out[sl], ctx)

        arrived = self._alltoall_in_segments(
            plan, ctx, lambda j, lo, hi: work.encode(lo, hi, ctx.encode_context(r, lo)))
        self._allgather_in_segments(plan, out, ctx,
                                    (owner_step(s, received) for s, received in arrived))
        if owner.enabled:
            owner.commit_fused(state, "owner")

    def _pipelined_in_two_phases(self, work, out, state, ctx, S):
        """Steps 2-5 in ``S`` segments for a codec whose pieces share their
        chunk's statistic (``chunk_statistic``; see the module docstring):
        every chunk's statistic first, then phase 1, the all-to-all, with
        piece ``s + 1`` encoded while ``s`` is on the wire and the owner
        adding up piece ``s`` as it arrives; the owner's statistic of its
        whole chunk; then phase 2, the allgather, with the owner's piece
        ``s + 1`` re-encoded while ``s`` is on the wire and piece ``s - 1``
        decoded after it."""
        codec, call, P, r = self.codec, ctx.call, self.size, self.rank
        plan = self._segment_plan(work.x.size, ctx.shape, S, state)
        bounds = self._plan(work.x.size, ctx.shape, state)[0]
        owner = ctx.memory.owner
        base, end = bounds[r], bounds[r + 1]
        e, e_out = self._owner_buffers(owner, state, end - base)
        e = None if e_out is None else e
        mine = out[base:end]
        with call.time("encode"):
            stats = [work.chunk_stat(bounds[j], bounds[j + 1], ctx.encode_context(r, bounds[j]))
                     for j in range(P)]

        # phase 1: the all-to-all, the owner's sum and moments piece by piece
        acc = codec.owner_begin()
        for s, received in self._alltoall_in_segments(
                plan, ctx,
                lambda j, lo, hi: work.encode_piece(lo, hi, stats[j], ctx.encode_context(r, lo))):
            lo, hi = plan[s][0][r]
            with call.time("encode"):
                codec.owner_add(received, e, mine, lo - base, hi - base, acc)
        with call.time("encode"):
            ostat = codec.owner_stat(acc, e, mine, ctx.encode_context(P + r, base))

        # phase 2: the owner's pieces re-encoded, the allgather, the decode
        def owner_piece(s):
            lo, hi = plan[s][0][r]
            with call.time("encode"):
                return codec.owner_encode_piece(e, e_out, mine, lo - base, hi - base, ostat,
                                                ctx.encode_context(P + r, lo))

        self._allgather_in_segments(plan, out, ctx, (owner_piece(s) for s in range(S)))
        if owner.enabled:
            owner.commit_fused(state, "owner")

    def _alltoall_in_segments(self, plan, ctx, encode):
        """The all-to-all of every segment of ``plan``, piece ``j`` of segment
        ``s`` encoded by ``encode(j, lo, hi)``: yields ``(s, received)``, the
        all-to-all of ``s + 1`` started before the one of ``s`` is waited for
        (its send packets kept until then)."""
        net, call, P, r = ctx.net, ctx.call, self.size, self.rank

        def start(s):
            pieces, sizes = plan[s]
            with call.time("encode"):
                packets = [encode(j, lo, hi) for j, (lo, hi) in enumerate(pieces)]
            in_place = sizes is not None and sum(sizes) > IN_PLACE_BYTES
            return net.ialltoallv(packets, None if sizes is None else [sizes[r]] * P,
                                  in_place=in_place), packets

        pending = start(0)
        for s in range(len(plan)):
            following = start(s + 1) if s + 1 < len(plan) else None
            received = pending[0].wait()
            pending = following
            yield s, received

    def _allgather_in_segments(self, plan, out, ctx, owner_packets):
        """The allgather of the owner's packet of every segment (taken from
        ``owner_packets`` in order: the owner step of a segment runs when its
        packet is asked for) and the decode of the other ranks' pieces,
        segment ``s - 1`` after the allgather of ``s`` is started."""
        codec, net, call, r = self.codec, ctx.net, ctx.call, self.rank

        def decode(s, gathered):
            with call.time("decode"):
                for j, (lo, hi) in enumerate(plan[s][0]):
                    if j != r:
                        codec.decode(gathered[j], out[lo:hi])

        gathering = None
        for s, packet in enumerate(owner_packets):
            started = (net.iallgatherv(packet, plan[s][1]), packet)
            if gathering is not None:
                decode(s - 1, gathering[0].wait())
            gathering = started
        decode(len(plan) - 1, gathering[0].wait())

    @staticmethod
    def _owner_buffers(owner, state, m):
        """The owner memory's ``(e, e_out)`` for a chunk of ``m``, or (None,
        None) without owner memory."""
        return owner.fused_buffers(state, "owner", m) if owner.enabled else (None, None)

    def _fused_owner(self, received, out, lo, hi, e, e_out, ctx):
        """Step 4 in the codec's ``owner_step`` for ``[lo, hi)``: decode-sum,
        compensate, re-encode, the owner residual and this rank's slice of
        ``out``, with the bits of the separate steps (the owner decodes its
        packet as the others will)."""
        with ctx.call.time("encode"):
            return self.codec.owner_step(received, e, e_out, out[lo:hi],
                                         ctx.encode_context(self.size + self.rank, lo))


class TwoShotPlan(RepeatPlan):
    """A key's repeated small ``twoshot`` call: steps 2-5 of
    :meth:`TwoShot._fused_exchange` with the chunk plan, the buffers and MPI
    arguments of both transfers
    (:class:`~hpccomm.collectives.transport.FixedExchange`) and a transport
    made once -- what the general path spends per call building them.

    With a codec that runs its kernels on packets laid out once and a
    memory that is a plain residual or none, the packets are laid out when
    the plan is made: the send packets in the all-to-all's send buffer, the
    owner's packet, and views of the received and gathered packets, all
    with their headers -- fixed-size packets (:class:`_Packets`, through
    :meth:`~hpccomm.codecs.base.Codec.bind_packet`), or slots for packets of
    varying size (:class:`_Slots`).  A call then runs one kernel per chunk
    and phase and the three collectives, nothing else
    (:meth:`_reduce_laid_out`):

    1. the encode of every chunk into its send packet (``v = x + e``,
       ``e_out``), stopping at a chunk with NaN/Inf; the deferred
       cross-rank check;
    2. the all-to-all of the send buffer as it lies;
    3. the owner step: the received packets summed in rank order, the owner
       residual, the owner's packet and its slice of ``out``;
    4. the allgather of the owner's packet;
    5. the decode of the other ranks' chunks; the residuals committed.

    The received and the gathered packets' headers are compared with
    those the plan expects, all in one vectorised comparison per transfer
    (:class:`_Headers`), before a kernel reads their payload: a corrupted
    packet is refused as the general path refuses it.  The bits, state,
    collectives and statistics are those of the general path."""

    def __init__(self, algorithm: TwoShot, bounds, exchange: FixedExchange, shape: tuple,
                 memory, slotted: bool = False):
        self.algorithm = algorithm
        self.bounds = bounds
        self.exchange = exchange
        self.slotted = slotted
        self.kernels = None
        if not memory.enabled or memory.fusable:
            self.kernels = (_Slots if slotted else _Packets).lay_out(
                algorithm.codec, bounds, exchange, shape, memory)
        if self.kernels is not None:
            self.kind = "kernels"
        else:       # the general path's steps need a transport
            self.net = Transport(exchange.comm, CallStats())

    def reduce(self, x, out, state, call, seed, shape, memory, finite, agree):
        if self.kernels is not None:
            self._reduce_laid_out(x, out, state, call, seed, memory, agree)
            return
        alg, net, exchange = self.algorithm, self.net, self.exchange
        net.call = call    # the transport is this plan's; its accounting is the call's
        ctx = ReduceContext(net=net, memory=memory, seed=seed, step=state.step, shape=shape,
                            finite=finite, agree=agree)
        work = Contribution(alg.codec, memory, state, x, alg.scratch, alg.fuses_feedback, finite)
        alg._fused_exchange(work, out, state, ctx, self.bounds,
                            *alg._fixed_transfers(exchange, call, self.bounds, self.slotted))
        work.commit(call)

    def _reduce_laid_out(self, x, out, state, call, seed, memory, agree):
        """Steps 1-5 of the class docstring."""
        kernels, exchange, r = self.kernels, self.exchange, self.exchange.rank
        t0 = time.perf_counter()
        # 1. the encodes and the deferred check
        if memory.enabled:
            e, e_out = memory.fused_buffers(state, "worker", x.size)
        else:       # the worker residual is not kept
            e, e_out = None, self.algorithm.scratch("e_out", x.size)
        err = kernels.encode(x, e, e_out, seed, r, state.step, self.algorithm.size)
        if agree is not None:
            agree(None if err is None else input_error(err, x, kernels.codec.name))
        elif err is not None:
            raise err
        t1 = time.perf_counter()
        call.t_encode += t1 - t0
        # 2. the all-to-all
        exchange.alltoallv(None, call)
        # 3. the owner step
        t2 = time.perf_counter()
        kernels.received_headers.check()
        lo, hi = self.bounds[r], self.bounds[r + 1]
        owner = memory.owner
        eo, eo_out = (owner.fused_buffers(state, "owner", hi - lo) if owner.enabled
                      else (None, None))
        kernels.owner(eo, eo_out, out[lo:hi])
        call.t_encode += time.perf_counter() - t2
        # 4. the allgather
        exchange.allgatherv(kernels.owner_packet, call)
        # 5. the other chunks decoded, the residuals committed
        t3 = time.perf_counter()
        kernels.gathered_headers.check()
        kernels.decode(out)
        if owner.enabled:
            owner.commit_fused(state, "owner")
        if memory.enabled:
            memory.commit_fused(state, "worker")
        call.t_decode += time.perf_counter() - t3


class _LaidOut:
    """What :class:`_Packets` and :class:`_Slots` share: per chunk ``(lo,
    hi, views, draw)`` of its packet in the all-to-all's send buffer, the
    owner's packet, views and draw, the checks of the received and gathered
    headers; and the encodes of every chunk (``encode_chunk``: the codec's
    kernel), their random streams set once per call where the codec's
    kernels draw (``draws``)."""

    __slots__ = ("codec", "draws", "encode_chunk", "sends", "owner_packet", "owner_views",
                 "owner_draw", "received_headers", "gathered_headers")

    def _lay_out_packets(self, codec, bounds, exchange, shape, memory, bind, slotted):
        """The send packets, the owner's and the header checks, each packet
        laid out by ``bind(packet, n, shape)`` (its views); returns the
        chunks' ``(lo, hi)``."""
        r = exchange.rank
        chunks = list(zip(bounds[:-1], bounds[1:]))
        m = bounds[r + 1] - bounds[r]
        feedback = memory.enabled
        self.codec = codec
        self.sends = [(lo, hi, bind(p, hi - lo, shape), Draw(lo, feedback))
                      for (lo, hi), p in zip(chunks, exchange.send_slots())]
        self.owner_packet = np.zeros(exchange.gather_counts[r], np.uint8)
        self.owner_views = bind(self.owner_packet, m, shape)
        self.owner_draw = Draw(bounds[r], feedback)
        others = [j for j in range(len(chunks)) if j != r]
        self.received_headers = _Headers(codec, shape, exchange.received, range(len(chunks)),
                                         [m] * len(chunks), slotted=slotted)
        self.gathered_headers = _Headers(codec, shape, exchange.gathered, others,
                                         [chunks[j][1] - chunks[j][0] for j in others],
                                         slotted=slotted)
        return chunks

    def encode(self, x, e, e_out, seed, rank, step, size):
        """Every chunk's encode; the error of the first with NaN/Inf, or None."""
        codec = self.codec
        if self.draws:      # this call's streams: as rank r, and as the owner P + r
            key = codec.draw_key(seed, rank, step)
            for send in self.sends:
                send[-1].key = key
            self.owner_draw.key = codec.draw_key(seed, size + rank, step)
        encode_chunk = self.encode_chunk
        for lo, hi, views, draw in self.sends:
            bad = encode_chunk(views, x[lo:hi], None if e is None else e[lo:hi], e_out[lo:hi],
                               draw)
            if bad and (err := codec.nonfinite_error(bad)) is not None:
                return err
        return None


class _Packets(_LaidOut):
    """The kernels of :meth:`TwoShotPlan._reduce_laid_out` on fixed-size
    packets laid out once: the codec's ``encode_views``, ``owner_views`` and
    ``decode_views`` (:meth:`~hpccomm.codecs.base.Codec.lays_out`), each
    stochastic encode reading its chunk's :class:`~hpccomm.codecs.base.Draw`,
    whose key is set once per call."""

    __slots__ = ("rows", "gathered")

    @classmethod
    def lay_out(cls, codec, bounds, exchange, shape, memory):
        """The packets laid out, or None where the codec has no such kernels
        or its received rows would be a copy."""
        if not codec.lays_out:
            return None
        r = exchange.rank
        received = exchange.received
        rows = codec.payload_row_views(received, bounds[r + 1] - bounds[r], shape)
        if received.stride is None or not all(
                np.shares_memory(a, received.buffer) for a in (rows if isinstance(rows, tuple)
                                                               else (rows,))
                if isinstance(a, np.ndarray) and a.size):
            return None     # the rows would be a copy made now, not a view of what arrives
        self = cls()
        chunks = self._lay_out_packets(codec, bounds, exchange, shape, memory,
                                       codec.bind_packet, False)
        self.draws, self.encode_chunk = codec.stochastic, codec.encode_views
        self.rows = rows
        self.gathered = [(lo, hi, codec.payload_views(exchange.gathered[j], hi - lo, shape))
                         for j, (lo, hi) in enumerate(chunks) if j != r]
        return self

    def owner(self, e, e_out, out):
        codec = self.codec
        bad = codec.owner_views(self.rows, e, e_out, out, self.owner_views, self.owner_draw)
        if bad and (err := codec.nonfinite_error(bad)) is not None:
            raise err

    def decode(self, out):
        for lo, hi, views in self.gathered:
            self.codec.decode_views(views, out[lo:hi], False)


class _Slots(_LaidOut):
    """The kernels of :meth:`TwoShotPlan._reduce_laid_out` on slots laid out
    once, for a codec whose packets vary in size: its ``encode_slot``,
    ``owner_slot`` and ``decode_slot``, where they apply
    (:meth:`~hpccomm.codecs.sparsifier.SparseCodec.slot_count`: ``topk`` and
    ``dgc`` where their selection is the exact top-k, ``threshold``,
    ``adaptive``), a stochastic one's reading its chunk's
    :class:`~hpccomm.codecs.base.Draw` (``SLOT_DRAWS``).  A packet a kernel
    refuses goes to the general path's step on the same bytes, which raises
    its error."""

    __slots__ = ("exchange", "shape", "rows", "owner_entries", "gathered")

    @classmethod
    def lay_out(cls, codec, bounds, exchange, shape, memory):
        """The slots laid out, or None where the codec has no slot kernels,
        they do not apply to some chunk, or ``nonfinite="propagate"``."""
        entries = getattr(codec, "slot_count", None)
        if entries is None or codec.nonfinite != "raise":
            return None
        ks = [entries(hi - lo, shape) for lo, hi in zip(bounds[:-1], bounds[1:])]
        if None in ks:
            return None
        r = exchange.rank
        self = cls()
        chunks = self._lay_out_packets(codec, bounds, exchange, shape, memory,
                                       codec.slot_views, True)
        self.draws, self.encode_chunk = codec.SLOT_DRAWS, codec.encode_slot
        self.exchange, self.shape = exchange, shape
        self.rows = codec.row_views(exchange.received.buffer.reshape(len(chunks), -1),
                                    bounds[r + 1] - bounds[r], shape)
        self.owner_entries = ks[r]
        self.gathered = [(j, lo, hi, codec.row_views(exchange.gathered[j], hi - lo, shape), ks[j])
                         for j, (lo, hi) in enumerate(chunks) if j != r]
        return self

    def owner(self, e, e_out, out):
        codec = self.codec
        status = codec.owner_slot(self.rows, self.owner_entries, e, e_out, out, self.owner_views,
                                  self.owner_draw)
        if status == BAD_PACKET:
            codec.owner_step([codec.packet_in_slot(p, out.size) for p in self.exchange.received],
                             e, e_out, out, EncodeContext(shape=self.shape))
            raise PacketError(f"{codec.name}: a packet received was refused")
        if status:
            raise codec.nonfinite_error(status)

    def decode(self, out):
        codec = self.codec
        for j, lo, hi, row, k in self.gathered:
            if not codec.decode_slot(row, k, out[lo:hi]):
                codec.decode(codec.packet_in_slot(self.exchange.gathered[j], hi - lo),
                             out[lo:hi])
                raise PacketError(f"{codec.name}: the packet from rank {j} was refused")


class _Headers:
    """The headers a plan expects of the packets ``sources`` of a receive
    buffer (``packets``: a :class:`~hpccomm.collectives.transport.Received`),
    of ``counts`` elements each: :meth:`check` compares them all with one
    gather and one comparison, and refuses a mismatch as the codec's header
    check does (:class:`~hpccomm.errors.PacketError`)."""

    def __init__(self, codec, shape, packets, sources, counts, slotted=False):
        self.codec, self.packets = codec, packets
        self.sources, self.counts = list(sources), list(counts)
        #: slots: the count (``extra``, bytes 4-7) varies and is not compared
        self.slotted = slotted
        fields = np.arange(HEADER_SIZE, dtype=np.intp)
        if slotted:
            fields = fields[(fields < 4) | (fields >= 8)]
        self.fields = fields
        starts = [packets[j].ctypes.data - packets.buffer.ctypes.data for j in self.sources]
        self.index = (np.asarray(starts, np.intp)[:, None] + fields).reshape(-1)
        expected = []
        for j, n in zip(self.sources, self.counts):
            packet = np.zeros(packets[j].size, np.uint8)
            if slotted:
                codec.bind_header(packet, n)
            else:
                codec.bind_packet(packet, n, shape)
            expected.append(packet[fields])
        self.expected = (np.concatenate(expected) if expected
                         else np.zeros(0, np.uint8))
        self.expected_bytes = self.expected.tobytes()

    def check(self) -> None:
        # bytes, not np.array_equal: 0.2 against 1.8 us, twice per call
        if self.packets.buffer[self.index].tobytes() == self.expected_bytes:
            return
        width = self.fields.size
        for i, (j, n) in enumerate(zip(self.sources, self.counts)):
            packet = self.packets[j]
            # raises for what it can name
            (self.codec.packet_in_slot if self.slotted else self.codec.check_header)(packet, n)
            want = self.expected[i * width:(i + 1) * width]
            if not np.array_equal(packet[self.fields], want):
                raise PacketError(f"{self.codec.name}: the packet from rank {j} has the "
                                  f"header {packet[:HEADER_SIZE].tobytes().hex()}, this "
                                  f"call's is {want.tobytes().hex()}")
