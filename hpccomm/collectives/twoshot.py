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
   encode) and keeps ``e_o = w - decode(packet)``.
5. One ``MPI_Allgatherv`` of the owner packets; every rank, the owner
   included, decodes all chunks from those bytes -- so every rank ends with
   the same bits.

Bytes per rank, for a codec with packet size ``C(m)`` for ``m`` elements:
``sum_{j != r} C(chunk_j)`` out in the all-to-all plus the other ranks' owner
packets in the allgather, about ``2 (P-1)/P * C(n)``.
"""
import numpy as np

from .base import Algorithm, chunk_bounds, register_algorithm


@register_algorithm
class TwoShot(Algorithm):
    name = "twoshot"

    fuses_feedback = True

    def exchange(self, work, out, state, ctx):
        codec, net, call, P, r = self.codec, ctx.net, ctx.call, self.size, self.rank
        n = work.x.size
        if P == 1:  # no communication: the codec round trip
            with call.time("encode"):
                packet = work.encode(0, n, ctx.encode_context(r))
            with call.time("decode"):
                codec.decode(packet, out)
            work.decoded(0, n, out)
            return
        bounds = chunk_bounds(n, P, codec.align(ctx.shape))
        lens = np.diff(bounds)
        with call.time("encode"):
            packets = [work.encode(int(bounds[j]), int(bounds[j + 1]),
                                   ctx.encode_context(r, bounds[j])) for j in range(P)]
        fixed = [codec.wire_size(int(m)) for m in lens] if codec.fixed_size else None
        recv_sizes = [fixed[r]] * P if fixed is not None else None
        received = net.alltoallv(packets, recv_sizes)
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        with call.time("decode"):
            acc = self.scratch("acc", hi - lo)
            acc[:] = 0
            for src in range(P):  # rank order: the same sum on every owner
                codec.decode_add(received[src], acc)
        owner = ctx.memory.owner
        w = owner.compensate(state, "owner", acc)
        with call.time("encode"):
            owner_packet = codec.reencode(w, ctx.encode_context(P + r, lo))
        gathered = net.allgatherv(owner_packet, fixed)
        with call.time("decode"):
            for j in range(P):
                codec.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
        owner.update(state, "owner", w, out[lo:hi])
