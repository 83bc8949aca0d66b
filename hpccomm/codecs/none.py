"""``none``: float32 values as they are (the lossless reference codec).

Layout (version 1): 16-byte header (``extra`` = 0), then ``n`` little-endian
float32 values.  Wire size ``16 + 4 n`` bytes.
"""
import numpy as np

from .base import HEADER_SIZE, Codec, register_codec


@register_codec
class NoneCodec(Codec):
    name = "none"
    codec_id = 0
    lossless = True
    summable = True
    input_dtypes = ("float32", "float64", "float16", "bfloat16")

    def __init__(self, nonfinite: str = "propagate"):
        super().__init__(nonfinite=nonfinite)

    def wire_size(self, n):
        return HEADER_SIZE + 4 * n

    def _encode(self, x, ctx):
        packet = self.new_packet(self.wire_size(x.size), x.size, zeroed=False)
        packet[HEADER_SIZE:].view(np.float32)[:] = x
        return packet

    def _decode_into(self, packet, header, out, add):
        values = packet[HEADER_SIZE:].view(np.float32)
        if add:
            out += values
        else:
            out[:] = values

    # summable form: the float32 values themselves
    def shared_scale(self, x):
        return None

    def to_summable(self, x, scale, ctx):
        return x

    def summable_dtype(self, nranks):
        return np.dtype(np.float32)

    def from_summable(self, total, scale, out, add=False):
        if add:
            out += total
        else:
            out[...] = total
        return out
