"""Device twin of ``dgc`` (:mod:`hpccomm.codecs.dgc`): DGC's threshold
estimation on the device, the packets of the host codec.

Built on :class:`hpccomm.device_codecs.topk.PairDevice` (same pair packet,
decoding, validation, error feedback and owner step; see that module for
the kernels, passes and ordering guarantees).  The selection
(:func:`hpccomm.codecs.dgc.dgc_select`'s steps):

1. The ``s`` strided magnitudes are gathered on the device (start from the
   counter RNG under DGC's salt, computed on the host with the host codec's
   function) and ``thr`` is their ``ceil(s * ratio)``-th largest, by radix
   select over their float32 bit patterns -- numpy's order, so the very
   float32 the host's ``np.partition`` returns.  The sample stays on the
   device.
2. One counting pass over ``v`` (per block: above ``thr``, tied with it);
   the counts and ``thr``'s bits come back (``8 (4 + 2 B)`` bytes, ``B =
   ceil(n / RUN_TILE)``).  While fewer than ``0.8 k`` pass and ``thr != 0``
   (at most ``max_iters`` times) the host lowers ``thr`` to
   ``float32(thr * 0.8)`` -- the host codec's float32 product, on the host --
   hands it to the device (a one-element fill) and counts again: one pass and
   one round trip per decay.
3. The last count's blocks give the compaction's offsets directly (no
   recount); more than ``k`` candidates are cut to the ``k`` largest, ties
   to the lower index, as in ``topk`` (radix select over the candidates and
   a second compaction).

Passes over ``n``: compensate (with error feedback), one count per
threshold tried, one compaction.
"""
from __future__ import annotations

import math

import numpy as np

from ..codecs.dgc import DECAY, DGC, LOWER, SALT, dgc_sample_size
from ..kernels.rng import stream_key
from .base import register_device_codec
from .topk import PairDevice


@register_device_codec("dgc")
class DGCDevice(PairDevice):
    """``dgc``: sampled threshold, decayed until enough entries pass."""

    host = DGC

    def _select(self, sel, ctx):
        codec, n, k = self.codec, sel.n, sel.k
        if k == 0:
            return self.new_pairs(n, 0)[0]
        s = dgc_sample_size(n, codec.ratio, codec.sample_ratio)
        key = stream_key(ctx.seed, ctx.rank, ctx.step, SALT)
        sel.radix(sel.sample(s, key, ctx.offset), min(s, max(1, math.ceil(s * codec.ratio))))
        thr, host = sel.count()
        count = sel.candidates(host)
        for _ in range(codec.max_iters):
            if count >= LOWER * k or thr == 0:
                break
            thr = np.float32(thr * DECAY)
            sel.set_threshold(thr)
            _, host = sel.count()
            count = sel.candidates(host)
        return sel.finish(host)
