"""``summable``: one ``MPI_Allreduce`` on integer codes with a shared scale.

For codecs whose contributions add code by code once every rank uses the same
scale (TernGrad after a MAX of its scaler, threshold with a global ``tau``,
QSGD with MAX-shared bucket scales, random-k with shared indices):

1. ``v = x + e``; ``s = MAX-allreduce(codec.shared_scale(v))`` (skipped when
   the codec has no scale to share);
2. ``c = codec.to_summable(v, s)`` -- small integer codes (or, for random-k,
   the float32 values at the shared indices);
3. ``t = SUM-allreduce(c)`` in ``codec.summable_dtype(P)``: int8 while
   ``P * max|code| <= 127``, wider beyond, so the sum cannot overflow;
4. ``out = codec.from_summable(t, s)``; error feedback (the template's)
   keeps ``e = v - from_summable(c, s)``.  The unbiased quantizers (qsgd,
   terngrad) have no contractive summable form: with error feedback they
   are refused (ValueError on every rank); randk sends its values unscaled.

Integer sums are exact and order-free, so every rank gets the same bits.
Bytes per rank ``~ 2 (P-1)/P * |c|`` plus the scales (modelled: MPI's internal traffic).
"""
import numpy as np

from .base import Algorithm, register_algorithm


@register_algorithm
class SummableAllreduce(Algorithm):
    name = "summable"

    def check_codec(self, codec):
        if not codec.summable:
            when = f" here: it is {codec.summable_when};" if codec.summable_when else ""
            raise ValueError(f"algorithm 'summable' needs a summable codec; {codec.name!r} is not"
                             f"{when} or try 'twoshot' or 'allgather'")

    def check_memory(self, memory):
        if memory.enabled and not self.codec.summable_feedback:
            raise ValueError(f"algorithm 'summable' cannot carry error feedback with codec "
                             f"{self.codec.name!r}: its codes share one scale across ranks and "
                             f"cannot be contracted per rank, and unbiased codes make the "
                             f"residual grow (use 'twoshot' or 'allgather', or "
                             f"error_feedback=False)")

    def exchange(self, work, out, state, ctx):
        codec, P, net, call = self.codec, self.size, ctx.net, ctx.call
        v = work.v
        with call.time("encode"):
            scale = codec.shared_scale(v)
        if scale is not None and P > 1:
            scale = np.ascontiguousarray(scale, dtype=np.float32)
            net.allreduce(scale, op="max")
        with call.time("encode"):
            codes = codec.to_summable(v, scale, work.context(ctx.encode_context(self.rank)))
            total = codes.astype(codec.summable_dtype(P), copy=True)
        if P > 1:
            net.allreduce(total)
        with call.time("decode"):
            codec.from_summable(total, scale, out)
            if ctx.memory.enabled:  # what this rank's codes stand for
                own = self.scratch("own", v.size)
                codec.from_summable(codes, scale, own)
                work.decoded(0, v.size, own)
