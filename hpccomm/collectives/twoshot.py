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
"""

from .base import Algorithm, chunk_bounds, register_algorithm


@register_algorithm
class TwoShot(Algorithm):
    name = "twoshot"

    fuses_feedback = True

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

    def exchange(self, work, out, state, ctx):
        codec, net, call, P, r = self.codec, ctx.net, ctx.call, self.size, self.rank
        n = work.x.size
        if P == 1:  # no communication: the codec round trip
            with call.time("encode"):
                packet, = work.encode_chunks([0, n], ctx, r)
            with call.time("decode"):
                codec.decode(packet, out)
            work.decoded(0, n, out)
            return
        bounds, fixed, recv_sizes = self._plan(n, ctx.shape, state)
        with call.time("encode"):
            packets = work.encode_chunks(bounds, ctx, r)
        received = net.alltoallv(packets, recv_sizes)
        lo, hi = bounds[r], bounds[r + 1]
        owner = ctx.memory.owner
        if ctx.fused and getattr(codec, "owner_step", None) is not None \
                and (owner.fusable or not owner.enabled):
            owner_packet = self._fused_owner(received, out, lo, hi, owner, state, ctx)
            gathered = net.allgatherv(owner_packet, fixed)
            with call.time("decode"):
                for j in range(P):
                    if j != r:  # the own chunk was written by the owner step
                        codec.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
            if owner.enabled:
                owner.commit_fused(state, "owner")
            return
        with call.time("decode"):
            acc = self.scratch("acc", hi - lo)
            acc[:] = 0
            for src in range(P):  # rank order: the same sum on every owner
                codec.decode_add(received[src], acc)
        w = owner.compensate(state, "owner", acc)
        with call.time("encode"):
            owner_packet = codec.reencode(w, ctx.encode_context(P + r, lo))
        gathered = net.allgatherv(owner_packet, fixed)
        with call.time("decode"):
            for j in range(P):
                codec.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
        owner.update(state, "owner", w, out[lo:hi])

    def _fused_owner(self, received, out, lo, hi, owner, state, ctx):
        """Step 4 in the codec's ``owner_step``: decode-sum, compensate,
        re-encode, the owner residual and this rank's slice of ``out``, with
        the bits of the separate steps (the owner decodes its packet as the
        others will)."""
        e, e_out = (owner.fused_buffers(state, "owner", hi - lo) if owner.enabled
                    else (None, None))
        with ctx.call.time("encode"):
            return self.codec.owner_step(received, e, e_out, out[lo:hi],
                                         ctx.encode_context(self.size + self.rank, lo))
