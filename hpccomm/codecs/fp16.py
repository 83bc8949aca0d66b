"""``fp16``: float32 values rounded to IEEE half precision (binary16).

Layout (version 1), little-endian::

    offset  size  field
    0       16    common header: codec id 1, extra = 0, n
    16      2 n   binary16 values, element i at 16 + 2 i

Wire size ``16 + 2 n`` bytes: 16 bits per element plus 128 bits of header.

Rounding is to nearest, ties to even.  Finite values whose rounding would
overflow (``|x| >= 65520``) **saturate** to +-65504, the largest half, so a
finite input never decodes to infinity (with error feedback the excess stays
in the residual).  Magnitudes below ``2**-14`` become half subnormals
(multiples of ``2**-24``); those up to ``2**-25`` become (signed) zero.  Non-finite input raises
:class:`~hpccomm.errors.NonFiniteError` by default; with
``nonfinite="propagate"`` +-inf stays +-inf and NaN stays NaN.  Not summable.

:mod:`hpccomm.codecs.bf16` shares this layout through :class:`HalfWidthCodec`.
"""
import numpy as np

from ..errors import PacketError
from ..kernels import halfwidth as K
from .base import HEADER_SIZE, Codec, payload_rows, register_codec


class HalfWidthCodec(Codec):
    """A 16-bit float format: header, then ``n`` uint16 bit patterns.

    Subclasses set ``_to_bits(u, out)`` (float32 bit patterns as uint32 ->
    uint16) and ``_from_bits(bits, out, add)`` (uint16 -> float32), kernels of
    :mod:`hpccomm.kernels.halfwidth`; ``bfloat`` says which format the fused
    encode rounds to."""

    bfloat = False

    def wire_size(self, n):
        return HEADER_SIZE + 2 * n

    def segment_unit(self, shape):
        return 1  # element by element

    def _payload_size(self, header):
        if int(header["extra"]) != 0:
            raise PacketError(f"{self.name}: header field 'extra' must be 0, "
                              f"not {int(header['extra'])}")
        return self.wire_size(int(header["n"]))

    def _encode(self, x, ctx):
        packet = self.new_packet(self.wire_size(x.size), x.size, zeroed=False)
        self._to_bits(x.view(np.uint32), packet[HEADER_SIZE:].view(np.uint16))
        return packet

    def _decode_into(self, packet, header, out, add):
        self.decode_views(packet[HEADER_SIZE:].view(np.uint16), out, add)

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` in one pass over the chunk
        (:func:`~hpccomm.kernels.halfwidth.half_owner_step`): the rank-order
        sum of the received packets, ``+ e``, its packet, ``e_out``
        (``e_out=None``: no owner residual) and ``out = decode(packet)``, with the bits of the separate steps.
        Returns the packet."""
        m = out.size
        for packet in received:
            self.check_packet(packet, out)
        packet, bits = self.new_bound_packet(m, ctx.shape)
        self._raise_nonfinite(self.owner_views(self.payload_row_views(received, m, ctx.shape),
                                               e, e_out, out, bits))
        return packet

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and
        ``e_out = v - decode(packet)`` in one pass
        (:func:`~hpccomm.kernels.halfwidth.half_encode_feedback`)."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        packet, bits = self.new_bound_packet(x.size, ctx.shape)
        self._raise_nonfinite(self.encode_views(bits, x, e, e_out))
        return packet

    # -- the kernels on laid-out packets (see Codec.bind_packet) --------------
    @staticmethod
    def payload_views(packet, n, shape):
        """``bits``: the ``n`` uint16 patterns."""
        return packet[HEADER_SIZE:HEADER_SIZE + 2 * n].view(np.uint16)

    @staticmethod
    def payload_row_views(packets, m, shape):
        return payload_rows(packets, HEADER_SIZE, np.uint16, m)

    def encode_views(self, bits, x, e, e_out, draw=None):
        return K.half_encode_feedback(x, x if e is None else e, e is not None, self.bfloat, bits,
                                      e_out)

    def owner_views(self, rows, e, e_out, out, bits, draw=None):
        return K.half_owner_step(rows, self.bfloat, out if e is None else e, e is not None,
                                 e_out is not None, bits, out if e_out is None else e_out, out)

    def decode_views(self, bits, out, add):
        self._from_bits(bits, out, add)


@register_codec
class Fp16Codec(HalfWidthCodec):
    name = "fp16"
    dense = True
    codec_id = 1
    _to_bits = staticmethod(K.f32_to_f16)
    _from_bits = staticmethod(K.f16_to_f32)

    def check_tolerance(self, nranks, error_feedback):
        # one rounding to 11 significant bits per stage (2**-11 relative), two stages
        return 2e-3
