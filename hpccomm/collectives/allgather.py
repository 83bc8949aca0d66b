"""``allgather``: every rank's packet to every rank; each decodes and sums.

The simplest compressed allreduce and the baseline that grows with ``P``:
every rank encodes its whole vector once (``v = x + e``), one
``MPI_Allgatherv`` moves the ``P`` packets (counts first when their size
depends on the data), and every rank decodes and adds them **in rank order**,
so every rank computes the same bits -- or through the codec's
``decode_sum(packets, out)`` where it has one (``ebq`` adds the integer
codes exactly, then rounds once).  Received bytes per rank:
``(P-1) * C(n)``; decode work grows with ``P`` too.  Worth it when packets are
tiny (strong sparsification) or ``P`` is small.
"""

from .base import Algorithm, register_algorithm


@register_algorithm
class AllgatherAllreduce(Algorithm):
    name = "allgather"

    fuses_feedback = True

    def exchange(self, work, out, state, ctx):
        codec, call, P, r = self.codec, ctx.call, self.size, self.rank
        n = work.x.size
        with call.time("encode"):
            packet, = work.encode_chunks([0, n], ctx, r)
        if P == 1:
            with call.time("decode"):
                codec.decode(packet, out)
            work.decoded(0, n, out)
            return
        size = codec.wire_size_for(n, ctx.shape)
        packets = ctx.net.allgatherv(packet, [size] * P if size is not None else None)
        with call.time("decode"):
            decode_sum = getattr(codec, "decode_sum", None)
            if decode_sum is not None:  # the codec sums them itself (ebq: integer codes)
                decode_sum(packets, out)
                return
            out[...] = 0
            for src in range(P):
                codec.decode_add(packets[src], out)
