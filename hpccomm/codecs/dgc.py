"""``dgc``: top-k with Deep Gradient Compression's threshold estimation
(Lin et al., ICLR 2018; official code ``synxlin/deep-gradient-compression``,
``dgc/compression.py``).

Parameters: ``ratio`` (default 0.001, DGC's ``compress_ratio``),
``sample_ratio`` (default 0.01) and ``max_iters`` (default 10, DGC's
``max_adaptation_iters``).  ``k = max(1, ceil(ratio * n))`` as in
:mod:`~hpccomm.codecs.topk`.

Selection (:func:`dgc_threshold`, :func:`dgc_finish`; zeros are never sent):

1. Sample ``s = min(n, max(ceil(sample_ratio * n), ceil(2 / ratio)))``
   magnitudes -- 1 % of the vector by default, and at least enough for two
   expected hits -- strided (``stride = n // s``) from a start drawn with the
   counter RNG (``hash_index(stream_key(seed, rank, step, SALT), offset)``).
   ``thr`` = the ``ceil(s * ratio)``-th largest sample (DGC: the minimum of
   the sample's top-k).
2. Count ``c = #{i : |x_i| >= thr, x_i != 0}``; then, at most ``max_iters``
   times: if ``c < 0.8 k`` lower the threshold, ``thr *= 0.8``, and count
   again; otherwise stop (DGC stops as well for ``c > 1.3 k`` and for
   ``0.8 k <= c <= 1.3 k``; step 3 trims either case).  A zero threshold
   already selects every non-zero and ends the loop.
3. Select at the final ``thr``; if more than ``k`` entries pass, keep the
   ``k`` largest magnitudes, ties to lower indices (DGC's "hierarchical
   top-k"; DGC itself truncates to the first ``k`` indices, we keep the
   largest).

So ``m <= k`` entries go out, typically ``0.8 k <= m <= k``.  The wire layout
is :mod:`~hpccomm.codecs.topk`'s (version 1: header with ``extra = m``, then
``m`` int32/int64 indices, then ``m`` float32 values; ``16 + (b + 4) m``
bytes, ``b = 4`` below ``2**31`` elements) under codec id 10.

DGC's optimizer-side parts -- momentum correction, momentum factor masking,
local gradient clipping and the sparsity warm-up -- are not codec work: see
:class:`hpccomm.dgc_optimizer.DGCMomentum`.
"""
import math

import numpy as np

from ..kernels import sparsify as K
from .sparsifier import check_fraction, index_dtype
from .base import EncodeContext, register_codec
from .topk import PairCodec

SALT = 0x00646763  # "dgc"
#: DGC's compress_lower_bound and threshold decay.  (Its compress_upper_bound,
#: 1.3, only decides between trimming now and trimming later: above it DGC
#: stops adapting, and so do we as soon as enough entries pass.)
LOWER = 0.8
DECAY = np.float32(0.8)


def dgc_sample_size(n: int, ratio: float, sample_ratio: float) -> int:
    return min(n, max(math.ceil(sample_ratio * n), math.ceil(2.0 / ratio)))


def dgc_threshold(sample: np.ndarray, ratio: float) -> np.float32:
    """Step 1's ``thr``: the ``ceil(s * ratio)``-th largest of the ``s``
    sampled magnitudes."""
    s = sample.size
    return K.kth_largest(sample, min(s, max(1, math.ceil(s * ratio))))


def dgc_finish(x: np.ndarray, thr, idx: np.ndarray, vals: np.ndarray, k: int,
               max_iters: int):
    """Steps 2-3 from the candidates ``(idx, vals)`` of ``x`` at ``thr``:
    ``(idx, vals)`` sorted by index."""
    count = idx.size
    lowered = False
    for _ in range(max_iters):
        if count >= LOWER * k or thr == 0:  # enough (too many: trimmed below)
            break
        thr = np.float32(thr * DECAY)
        count = K.count_abs_ge(x, thr)
        lowered = True
    if lowered:
        idx, vals = K.select_abs_ge(x, thr, index_dtype(x.size))
    return K.keep_largest(idx, vals, k)


@register_codec
class DGC(PairCodec):
    name = "dgc"
    codec_id = 10
    salt = SALT

    def __init__(self, ratio: float = 0.001, sample_ratio: float = 0.01, max_iters: int = 10,
                 nonfinite: str = "raise"):
        super().__init__(ratio, nonfinite=nonfinite)
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)
        if int(max_iters) != max_iters or max_iters < 0:
            raise ValueError(f"max_iters must be an integer >= 0, not {max_iters!r}")
        self.max_iters = int(max_iters)

    def params(self):
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio,
                "max_iters": self.max_iters}

    def _sample_size(self, n, k):
        return dgc_sample_size(n, self.ratio, self.sample_ratio)

    def exact_count(self, n, shape=None):
        """``k`` where the sample is the whole vector and its threshold the
        ``k'``-th largest magnitude with ``k' >= k``: step 2 lowers nothing,
        and step 3 keeps the exact top-``k``."""
        k = self.max_count(n)
        if dgc_sample_size(n, self.ratio, self.sample_ratio) != n:
            return None
        return k if min(n, max(1, math.ceil(n * self.ratio))) >= k else None

    def _threshold(self, sample, n, k):
        return dgc_threshold(sample, self.ratio)

    def _finish(self, x, t, idx, vals, k):
        return dgc_finish(x, t, idx, vals, k, self.max_iters)


def dgc_select(x: np.ndarray, ratio: float, sample_ratio: float, max_iters: int,
               ctx: EncodeContext):
    """DGC's selection of at most ``k = max(1, ceil(ratio n))`` entries of
    ``x`` (steps 1-3 above), the codec's own: ``(idx, vals)`` sorted by index."""
    return DGC(ratio, sample_ratio, max_iters)._pairs(x, ctx)
