"""Device twin of ``onebit`` (:mod:`hpccomm.codecs.onebit`).

Kernels (:mod:`hpccomm.kernels.cuda_quantize`):
:func:`~hpccomm.kernels.cuda_quantize.onebit_columns`, one thread per
column, sums the column's entries ``>= 0`` and ``< 0`` in float64 lanes --
element ``i`` in lane ``(i - lo) mod 32``, each lane in index order, then
the fixed pairwise lane tree, the CPU's order -- and writes the two means;
when the column length is a multiple of 32 (columns of whole sign words) the
same thread then takes a second look at its column (from cache) for the sign
words, ``e_out = v - decode`` and ``out = decode``.  Otherwise
:func:`~hpccomm.kernels.cuda_quantize.onebit_words` does that per word.

Passes over memory:

* ``encode_with_feedback``: one (reading ``x`` and ``e`` twice per column,
  the second time from cache) with columns of whole words, else two;
* ``owner_step``: the same, the received packets (up to four, decoded as
  they are read, summed in rank order) and ``e`` in place of ``x`` and
  ``e``; each further four received packets add a pass over ``out``;
* ``decode``: one.

Received packets are decoded with their own column length (the header's
``extra``, read on the device); the host's check that all packets of a chunk
share it is the caller's.
"""
import numpy as np

from ..codecs.onebit import OneBitCodec, packet_size
from ..kernels import cuda_quantize as Q
from ._dense import DenseDevice
from .base import register_device_codec


@register_device_codec("onebit")
class OneBitDevice(DenseDevice):
    host = OneBitCodec
    _decode_kernel = staticmethod(Q.onebit_decode)
    _presum_kernel = staticmethod(Q.onebit_presum)

    def _views(self, packet):
        return packet.view(np.uint32), packet.view(np.float32)

    def _code(self, src, n, e_out, out, ctx, count):
        col_len = min(self.codec.column_length(ctx.shape, n), max(n, 1))
        ncols = -(-n // col_len)
        packet = self.new_packet(packet_size(n, col_len), n, extra=col_len)
        pw, pf = self._views(packet)
        outputs = self._outputs(src, e_out, out)
        whole = col_len % 32 == 0
        bad = self._counter(count)
        Q.launch_grid(Q.onebit_columns, ncols, *src, n, col_len, ncols, pf, pw, whole,
                      *outputs, bad, count)
        self._check(bad, count)
        if not whole:
            Q.launch_grid(Q.onebit_words, -(-n // 32), *src, n, col_len, ncols, pf, pw,
                          *outputs)
        return packet
