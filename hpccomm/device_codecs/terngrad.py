"""Device twin of ``terngrad`` (:mod:`hpccomm.codecs.terngrad`).

The scale is a max and a standard deviation over the whole vector:
:func:`~hpccomm.kernels.cuda_quantize.tern_lanes` runs one block of 32
threads, thread ``k`` summing ``v - v[0]``, its square and ``|v|`` over the
elements ``i = k mod 32`` in index order (float64; products unfused) and
keeping their ``max |v|`` -- the CPU's lanes -- and
:func:`~hpccomm.kernels.cuda_quantize.tern_totals` (one thread) combines them
by the fixed lane tree into ``(max|v|, S1, S2, L1, L2, NaN/Inf count)``.
Those six numbers come back to the host, which takes the scale and the
stored (error-feedback) scale with the host codec's own code
(``_scale_from``, ``_unit``); :func:`~hpccomm.kernels.cuda_quantize.tern_code`
then draws the codes per byte and writes ``e_out`` and ``out``.

Passes over memory:

* ``encode_with_feedback``: two -- the moments (read ``x``, ``e``), then
  codes and residual (read ``x``, ``e``, write the packet and ``e_out``);
* ``owner_step``: the same two with the received packets (up to four,
  decoded as read, in rank order) and ``e`` in place of ``x`` and ``e``,
  ``out`` written by the second; each further four add a pass over ``out``;
* ``decode``: one.

Every call waits for its six numbers (one device-to-host copy): the scale
needs all of ``v`` before any code.
"""
import numpy as np

from ..codecs.terngrad import TernGradCodec
from ..kernels import cuda_quantize as Q
from ..kernels import cuda_util as U
from ._dense import DenseDevice
from .base import register_device_codec

_LANES = Q.LANES


@register_device_codec("terngrad")
class TernGradDevice(DenseDevice):
    host = TernGradCodec
    _decode_kernel = staticmethod(Q.tern_decode)
    _presum_kernel = staticmethod(Q.tern_presum)

    def _views(self, packet):
        return packet, packet[:20].view(np.float32)

    def _moments(self, src, n):
        """``(max|v|, S1, S2, L1, L2, count)`` of the source, as
        :func:`~hpccomm.kernels.terngrad.tern_stats` returns them."""
        if n == 0:
            return np.float32(0.0), 0.0, 0.0, 0.0, 0.0, 0
        lanes = self.scratch("lanes", 3 * _LANES + 1, np.float64)
        maxes = self.scratch("maxes", _LANES, np.float32)
        counts = self.scratch("counts", _LANES, np.int64)
        res = self.scratch("res", 6, np.float64)
        U.launch(_LANES, Q.tern_lanes, _LANES, *src, n, lanes, maxes, counts)  # one block
        U.single(Q.tern_totals, n, lanes, maxes, counts, res)
        top, s1, s2, l1, l2, bad = (float(r) for r in U.to_host(res))
        return np.float32(top), s1, s2, l1, l2, int(bad)

    def _code(self, src, n, e_out, out, ctx, count):
        codec = self.codec
        maxabs, s1, s2, l1, l2, bad = self._moments(src, n)
        if count:
            self.raise_nonfinite(bad)
        s = codec._scale_from(n, maxabs, s1, s2, ctx)
        unit = np.float32(codec._unit(s, maxabs, l1, l2, ctx))
        packet = self.new_packet(codec.wire_size(n), n)
        Q.launch_grid(Q.tern_code, max(-(-n // 4), 1), *src, n, codec._key(ctx),
                      int(ctx.offset), np.float32(s), unit, unit.view(np.uint32), packet,
                      packet[:20].view(np.uint32), *self._outputs(src, e_out, out))
        return packet
