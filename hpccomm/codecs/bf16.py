"""``bf16``: float32 values rounded to bfloat16 (the top 16 bits of a float32).

Layout (version 1), little-endian::

    offset  size  field
    0       16    common header: codec id 2, extra = 0, n
    16      2 n   bfloat16 bit patterns, element i at 16 + 2 i

Wire size ``16 + 2 n`` bytes: 16 bits per element plus 128 bits of header.

Rounding is to nearest, ties to even (as
:func:`hpccomm.buffers.f32_to_bf16_bits`, the same kernel), except that finite values whose
rounding would overflow (``|x| >= 0x7F7F8000`` as bits, about 3.3961e38)
**saturate** to +-3.3895e38, the largest bfloat16, so a finite input never
decodes to infinity.  Non-finite input raises
:class:`~hpccomm.errors.NonFiniteError` by default; with
``nonfinite="propagate"`` +-inf stays +-inf and NaN stays (quiet) NaN.
Decoding is exact (a shift).  Not summable.
"""
from ..kernels import halfwidth as K
from .base import register_codec
from .fp16 import HalfWidthCodec


@register_codec
class Bf16Codec(HalfWidthCodec):
    name = "bf16"
    dense = True
    codec_id = 2
    bfloat = True
    _from_bits = staticmethod(K.bf16_to_f32)

    @staticmethod
    def _to_bits(u, out):
        K.f32_to_bf16(u, out, True)   # finite values saturate (see the module docstring)

    def check_tolerance(self, nranks, error_feedback):
        # one rounding to 8 significant bits per stage (2**-8 relative), two stages
        return 2e-2
