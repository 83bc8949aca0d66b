"""Device twin of ``qsgd`` (:mod:`hpccomm.codecs.qsgd`).

:func:`~hpccomm.kernels.cuda_quantize.qsgd_buckets`, one thread per bucket,
takes the bucket's scale as the CPU does -- float64 lanes of ``v**2`` (or
lane maxima of ``|v|``), element ``i`` in lane ``(i - lo) mod 32``, each
lane in index order, then the fixed pairwise lane tree; products unfused --
and under error feedback the contraction from the lane sums of ``|v|`` and
``v**2``; when a bucket holds whole code bytes (``bucket * bits`` a
multiple of 8, as the default 512 does) the same thread then codes its
bucket from cache, writing ``e_out`` and ``out``.  Otherwise
:func:`~hpccomm.kernels.cuda_quantize.qsgd_bytes` codes per byte from the
buckets' ratios and units.

Passes over memory:

* ``encode_with_feedback``: one (each bucket read twice, the second time
  from cache) for buckets of whole bytes, else two;
* ``owner_step``: the same with the received packets (up to four, decoded
  as read, in rank order) and ``e`` in place of ``x`` and ``e``; each
  further four add a pass over ``out``;
* ``decode``: one.

Received packets are decoded with their own bit width and bucket (the
header's ``extra``, read on the device); the host's check that all packets
of a chunk share them is the caller's.

Fixed-width codes only: ``elias=True`` (variable-length, branchy bit
streams, CPU work by design -- ALGORITHMS.md's "use fixed width on GPUs")
is refused (:meth:`QSGDDevice.refuses`), and the device path stages such
calls through the host.
"""
import numpy as np

from ..codecs.qsgd import QSGDCodec, packet_size
from ..kernels import cuda_quantize as Q
from ._dense import DenseDevice
from .base import register_device_codec


@register_device_codec("qsgd")
class QSGDDevice(DenseDevice):
    host = QSGDCodec
    _decode_kernel = staticmethod(Q.qsgd_decode)
    _presum_kernel = staticmethod(Q.qsgd_presum)

    @classmethod
    def refuses(cls, codec):
        if getattr(codec, "elias", False):
            return ("elias=True has no device kernels (variable-length Elias streams are "
                    "CPU work; the device twin writes fixed-width codes)")
        return ""

    def _views(self, packet):
        return packet, packet[:packet.size - packet.size % 4].view(np.float32)

    def _code(self, src, n, e_out, out, ctx, count):
        codec = self.codec
        bits, levels = codec.bits, codec.levels
        bucket = min(codec.bucket, max(n, 1))
        nb = -(-n // bucket)
        packet = self.new_packet(packet_size(n, bits, bucket), n, extra=bucket | bits << 28)
        pf = packet[:16 + 4 * nb].view(np.float32)
        key, offset = codec._key(ctx), int(ctx.offset)
        ratios = self.scratch("ratios", nb, np.float64)
        units = self.scratch("units", nb, np.float64)
        outputs = self._outputs(src, e_out, out)
        whole = bucket * bits % 8 == 0
        bad = self._counter(count)
        Q.launch_grid(Q.qsgd_buckets, nb, *src, n, bucket, bits, levels, codec.norm == "max",
                      key, offset, *codec._contract(n, bucket, ctx), pf, packet, nb, ratios,
                      units, whole, *outputs, bad, count)
        self._check(bad, count)
        if not whole:
            Q.launch_grid(Q.qsgd_bytes, -(-(n * bits) // 8), *src, n, bucket, bits, levels,
                          key, offset, packet, nb, ratios, units, *outputs)
        return packet
