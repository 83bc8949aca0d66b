"""``fp8``: block-scaled FP8 (OCP e4m3 or e5m2) with a float32 scale per block.

Each block -- a run of ``B`` consecutive elements, the last one possibly
shorter; ``B`` the ``block`` parameter, one of 32, 64, 128, 256 -- is sent as
one float32 scale and ``B`` one-byte FP8 codes::

    amax = max |v_i| over the block's finite entries (0 if none)
    s    = float32(amax / FP_MAX)        FP_MAX = 448 (e4m3), 57344 (e5m2)
    q_i  = fp8(float32(v_i / d))         d = s, or 1 where s == 0
    decode: float32(value(q_i) * s)

Both the division ``v_i / d`` and the product ``value(q_i) * s`` are single
IEEE float32 operations (a division, not a multiplication by a reciprocal:
one rounding, so ``|v_i / s| <= FP_MAX (1 + 2**-23)`` and the block maximum
comes out at ``FP_MAX``), then ``fp8`` rounds to nearest, ties to even,
as ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` do, except that finite
values beyond the largest finite FP8 **saturate** to +-448 / +-57344 (a
subnormal scale can push ``v_i / s`` there; error feedback keeps the
excess).  e4m3 subnormals are multiples of ``2**-9``, e5m2's of ``2**-16``.
An all-zero block has scale 0 and codes +-0.  The rounding is integer
arithmetic on float32 bit patterns
(:func:`hpccomm.kernels.fp8._fp8_bits`), so every rank and machine
produces the same bytes.

Non-finite input raises :class:`~hpccomm.errors.NonFiniteError` by default.
With ``nonfinite="propagate"`` the scale comes from the block's finite
entries, NaN encodes as the FP8 NaN (``0x7F`` / ``0x7E`` with its sign)
and decodes to NaN, +-inf decodes to +-inf in e5m2 and to NaN in e4m3
(``e4m3fn`` has no infinity); the other entries of the block are unaffected.
Not summable; biased (deterministic rounding to 3 or 2 mantissa bits drops
entries below ``2**-9 / 448`` of the block maximum, e4m3), so error feedback
is on by default.

Layout (version 1), little-endian::

    offset       size    field
    0            16      common header: codec id 11, extra = B | F << 16
                         (F: 0 = e4m3, 1 = e5m2; other bits 0), n
    16           4 C     float32 scale of block c (C = ceil(n / B)), at 16 + 4 c
    16 + 4 C     n       FP8 codes, element i at byte 16 + 4 C + i

Wire size ``16 + 4 ceil(n / B) + n`` bytes: ``8 + 32 / B`` bits per element
(9 for B = 32) plus 128 bits of header.  Blocks are independent:
:meth:`Fp8Codec.align` and :meth:`Fp8Codec.segment_unit` return ``B`` so
that chunked algorithms cut at block boundaries.
"""
import numpy as np

from ..errors import PacketError
from ..kernels import fp8 as K
from .base import HEADER_SIZE, Codec, payload_rows, register_codec

#: the formats, by name: their header code
FORMATS = {"e4m3": K.FP8_E4M3, "e5m2": K.FP8_E5M2}
#: the block lengths allowed
BLOCKS = (32, 64, 128, 256)


def _packet_size(n: int, block: int) -> int:
    return HEADER_SIZE + 4 * (-(-n // block)) + n


@register_codec
class Fp8Codec(Codec):
    name = "fp8"
    dense = True
    codec_id = 11
    biased = True

    def __init__(self, format: str = "e4m3", block: int = 32, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if not isinstance(format, str) or format not in FORMATS:
            raise ValueError(f"fp8: format must be 'e4m3' or 'e5m2', not {format!r}")
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) \
                or int(block) not in BLOCKS:
            raise ValueError(f"fp8: block must be one of 32, 64, 128, 256, not {block!r}")
        self.format = format
        self.block = int(block)
        self.e5m2 = format == "e5m2"

    def params(self):
        return {"format": self.format, "block": self.block}

    @property
    def _extra(self):
        return self.block | FORMATS[self.format] << 16

    def align(self, shape):
        return self.block

    def segment_unit(self, shape):
        return self.block   # blocks are independent

    def wire_size(self, n):
        return _packet_size(n, self.block)

    def _payload_size(self, header):
        extra = int(header["extra"])
        block, fmt = extra & 0xFFFF, extra >> 16
        if block not in BLOCKS:
            raise PacketError(f"fp8: block field {block} is not one of 32, 64, 128, 256")
        if fmt not in (K.FP8_E4M3, K.FP8_E5M2):
            raise PacketError(f"fp8: format field {fmt} is not 0 (e4m3) or 1 (e5m2)")
        return _packet_size(int(header["n"]), block)

    def _fields(self, packet, n, block):
        ns = -(-n // block)
        scales = packet[HEADER_SIZE:HEADER_SIZE + 4 * ns].view(np.float32)
        return scales, packet[HEADER_SIZE + 4 * ns:]

    def _encode(self, x, ctx):
        n = x.size
        packet = self.new_packet(self.wire_size(n), n, extra=self._extra, zeroed=False)
        scales, codes = self._fields(packet, n, self.block)
        K.fp8_encode(x, self.e5m2, self.block, scales, codes)
        return packet

    def _decode_into(self, packet, header, out, add):
        extra = int(header["extra"])
        block = extra & 0xFFFF
        scales, codes = self._fields(packet, out.size, block)
        if scales.size and packet.ctypes.data % 4:   # unaligned receive buffer
            scales = scales.copy()
        K.fp8_decode(codes, scales, extra >> 16 == K.FP8_E5M2, block, out, add)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and
        ``e_out = v - decode(packet)`` in one pass, block by block
        (:func:`~hpccomm.kernels.fp8.fp8_encode_feedback`)."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        n = x.size
        packet = self.new_packet(self.wire_size(n), n, extra=self._extra, zeroed=False)
        scales, codes = self._fields(packet, n, self.block)
        bad = K.fp8_encode_feedback(x, x if e is None else e, e is not None, self.e5m2,
                                    self.block, scales, codes, e_out)
        self._raise_nonfinite(bad)
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot``
        (:func:`~hpccomm.kernels.fp8.fp8_owner_step`): the rank-order
        sum of the decoded received packets, ``+ e``, its packet, ``e_out``
        (``e_out=None``: no owner residual) and ``out = decode(packet)``,
        with the bits of the separate steps.  Returns the packet."""
        m = out.size
        for packet in received:
            extra = int(self.check_packet(packet, out)["extra"])
            if extra != self._extra:
                raise PacketError(f"fp8: a received packet has extra field {extra}, "
                                  f"this codec {self._extra}")
        ns = -(-m // self.block)
        rscales = payload_rows(received, HEADER_SIZE, np.float32, ns)
        rcodes = payload_rows(received, HEADER_SIZE + 4 * ns, np.uint8, m)
        packet = self.new_packet(self.wire_size(m), m, extra=self._extra, zeroed=False)
        scales, codes = self._fields(packet, m, self.block)
        bad = K.fp8_owner_step(rscales, rcodes, self.block, self.e5m2,
                               out if e is None else e, e is not None, e_out is not None,
                               self.block, scales, codes, out if e_out is None else e_out, out)
        self._raise_nonfinite(bad)
        return packet

    def check_tolerance(self, nranks, error_feedback):
        # one rounding to 4 (e4m3) / 3 (e5m2) significant bits per stage,
        # relative to each element: about 2**-5 / 2**-4 RMS, two stages
        return 0.2 if self.e5m2 else 0.1
