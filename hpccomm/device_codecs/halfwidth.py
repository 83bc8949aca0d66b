"""Device twins of ``fp16`` and ``bf16`` (:mod:`hpccomm.codecs.fp16`,
:mod:`hpccomm.codecs.bf16`).

Rounding is done on bit patterns in integers
(:func:`~hpccomm.kernels.cuda_quantize.f16_round`,
:func:`~hpccomm.kernels.cuda_quantize.bf16_round`, widening by
:func:`~hpccomm.kernels.cuda_quantize.f16_value_bits`): nearest even,
the host's saturation, subnormals and quiet NaN, exactly.

Passes over memory (kernel :func:`~hpccomm.kernels.cuda_quantize.half_code`,
element by element):

* ``encode_with_feedback``: one -- read ``x`` and ``e``, write the packet
  and ``e_out``;
* ``owner_step``: one for up to four received packets -- read them and
  ``e``, sum in rank order (``0 + d0 + d1 + ...``, then ``+ e``, float32),
  write the packet, ``e_out`` and ``out``; each further four add one pass
  over ``out`` first (:func:`~hpccomm.kernels.cuda_quantize.half_presum`);
* ``decode``: one.

No sums beyond the rank-order float32 additions, so no order to keep.
"""
import numpy as np

from ..codecs.bf16 import Bf16Codec
from ..codecs.fp16 import Fp16Codec, HalfWidthCodec
from ..kernels import cuda_quantize as Q
from ._dense import DenseDevice
from .base import register_device_codec


class HalfWidthDevice(DenseDevice):
    """fp16 / bf16: header, then ``n`` uint16 bit patterns."""

    host = HalfWidthCodec
    _decode_kernel = staticmethod(Q.half_decode)
    _presum_kernel = staticmethod(Q.half_presum)

    def _flag(self):
        return bool(self.codec.bfloat)

    def _views(self, packet):
        ph = packet.view(np.uint16)
        return ph, ph

    def _code(self, src, n, e_out, out, ctx, count):
        packet = self.new_packet(self.codec.wire_size(n), n)
        bad = self._counter(count)
        Q.launch_grid(Q.half_code, n, *src, n, packet.view(np.uint16),
                      *self._outputs(src, e_out, out), bad, count)
        self._check(bad, count)
        return packet


@register_device_codec("fp16")
class Fp16Device(HalfWidthDevice):
    host = Fp16Codec


@register_device_codec("bf16")
class Bf16Device(HalfWidthDevice):
    host = Bf16Codec
