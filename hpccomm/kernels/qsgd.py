"""CPU kernels of the ``qsgd`` codec: per-bucket scales (l2 or max norm),
stochastic codes of ``L`` levels, error feedback and the owner step.

* random numbers: element ``i`` of the encoded vector draws
  ``u_i = uniform01(key, offset + i)`` (:mod:`hpccomm.kernels.rng`);
* QSGD takes ``a_i = |x_i| * (L / scale)`` in float64 (``L`` levels, the
  product rounded before the sum) and level ``min(floor(a_i + u_i), L)``:
  ``floor(a_i) + 1`` with probability ``a_i - floor(a_i)``.  A bucket whose
  scale is zero or not finite gets all-zero codes;
* the codes are the ``b``-bit codes of :mod:`.bitcodes`.

Sums are the lane sums of :mod:`.quant_common`.
:mod:`hpccomm.kernels.cuda_quantize` produces the same bytes on a GPU.
"""
import numpy as np
from numba import njit

from .bitcodes import _decode_sum_range, _pack_block, _scale_codes
from .prefetch import prefetch_ahead
from .quant_common import (BLOCK, F32_MAX, LANES, ROWS, _count_nonfinite, _lane_total,
                           _row_split, _v, strided_rows)
from .rng import U64_GOLDEN, bits24_weyl_cpu, weyl_cpu


@njit(cache=True, nogil=True, inline="always")
def _sumsq_rows(x, e, lo, rows, lanes, acc):
    base = np.uint64(lo)
    for k in range(lanes):
        a = acc[k]
        for r in range(rows):
            w = np.float64(_v(x, e, base + np.uint64(r * LANES + k)))
            a += w * w
        acc[k] = a


@njit(cache=True, nogil=True, inline="always")
def _absmax_rows(x, e, lo, rows, lanes, mx):
    """Lane maxima of ``|v|`` (NaN ignored); returns whether a NaN was seen."""
    base = np.uint64(lo)
    nan = False
    for k in range(lanes):
        a_max = mx[k]
        for r in range(rows):
            a = np.float64(abs(_v(x, e, base + np.uint64(r * LANES + k))))
            a_max = a if a > a_max else a_max
            nan |= a != a
        mx[k] = a_max
    return nan


@njit(cache=True, nogil=True)
def _bucket_scale(x, e, lo, hi, use_max, acc):
    """``(scale, bad)`` of the bucket ``[lo, hi)`` of ``v = x + e`` (``x`` for
    ``e=None``): the float32 scale -- max |v| (NaN if any NaN), or the l2
    norm from float64 lane sums of squares, rounded once (finite norms beyond
    the float32 range saturate to its maximum) -- and how many ``v`` are
    non-finite (counted only when the max or the sum of squares is not
    finite or a NaN was seen).  Lane ``k`` takes the elements ``i - lo = k
    mod LANES`` in index order, :data:`ROWS` rows at a time so that the lane
    loop vectorizes.  ``acc``: 2 LANES float64 scratch."""
    full, body = _row_split(hi - lo)
    g = ROWS * LANES
    rows = (body - full) // LANES
    lanes = acc[:LANES]
    for k in range(LANES):
        lanes[k] = 0.0
    if use_max:
        nan = False
        for r0 in range(0, full, g):
            prefetch_ahead(x, e, lo + r0, lo + r0 + g)
            nan |= _absmax_rows(x, e, lo + r0, ROWS, LANES, lanes)
        nan |= _absmax_rows(x, e, lo + full, rows, LANES, lanes)
        nan |= _absmax_rows(x, e, lo + body, 1, hi - lo - body, lanes)
        top = lanes.max()
        if nan or not np.isfinite(top):
            return (np.float32(np.nan) if nan else np.float32(top)), \
                _count_nonfinite(x, e, lo, hi)
        return np.float32(top), 0
    for r0 in range(0, full, g):
        prefetch_ahead(x, e, lo + r0, lo + r0 + g)
        _sumsq_rows(x, e, lo + r0, ROWS, LANES, lanes)
    _sumsq_rows(x, e, lo + full, rows, LANES, lanes)
    _sumsq_rows(x, e, lo + body, 1, hi - lo - body, lanes)
    ss = _lane_total(acc, 0)
    bad = 0 if np.isfinite(ss) else _count_nonfinite(x, e, lo, hi)
    r = np.sqrt(ss)
    if r > F32_MAX and r < np.inf:
        r = F32_MAX
    return np.float32(r), bad


@njit(cache=True, nogil=True, inline="always")
def _norm_rows(x, e, lo, rows, lanes, acc):
    base = np.uint64(lo)
    for k in range(lanes):
        a1 = acc[k]
        a2 = acc[LANES + k]
        for r in range(rows):
            w = np.float64(_v(x, e, base + np.uint64(r * LANES + k)))
            a1 += abs(w)
            a2 += w * w
        acc[k] = a1
        acc[LANES + k] = a2


@njit(cache=True, nogil=True)
def _bucket_norms(x, e, lo, hi, acc):
    """``(sum|v|, sum(v**2))`` over the bucket ``[lo, hi)`` of ``v = x + e``
    (``x`` for ``e=None``) in float64 lanes, as :func:`_bucket_scale` sums
    (``acc``: 2 LANES float64 scratch).  Error feedback's contraction takes
    them right after the scale: the bucket is read from cache."""
    full, body = _row_split(hi - lo)
    g = ROWS * LANES
    for k in range(2 * LANES):
        acc[k] = 0.0
    for r0 in range(0, full, g):
        _norm_rows(x, e, lo + r0, ROWS, LANES, acc)
    _norm_rows(x, e, lo + full, (body - full) // LANES, LANES, acc)
    _norm_rows(x, e, lo + body, 1, hi - lo - body, acc)
    l1 = _lane_total(acc, 0)
    return l1, _lane_total(acc, LANES)


@njit(cache=True, nogil=True)
def bucket_scales(x, bucket, use_max, scales):
    """Per-bucket scales of ``x`` (see :func:`_bucket_scale`)."""
    n = x.size
    acc = np.zeros(2 * LANES)
    for j in range(scales.size):
        lo = j * bucket
        scales[j] = _bucket_scale(x, None, lo, min(lo + bucket, n), use_max, acc)[0]


@njit(cache=True, nogil=True, inline="always")
def _ratio(scale, levels):
    """``levels / scale`` in float64, or 0 when the bucket gets zero codes."""
    if scale > 0 and scale < np.inf:
        return levels / np.float64(scale)
    return 0.0


#: ``2**24``: :func:`_qsgd_block` works on ``a + u`` scaled by it
_F64_2P24 = float(1 << 24)


@njit(cache=True, nogil=True, inline="always")
def _qsgd_block(x, e, e_out, lo, hi, key, ratio, unit, levels, codes):
    """``codes[i - lo]`` for ``i`` in ``[lo, hi)``: the QSGD code (see
    :func:`qsgd_codes`) of ``v = x[i] + e[i]`` (``x[i]`` for ``e=None``) drawn
    with ``uniform01(key, i)``; ``ratio == 0`` (a zero or non-finite scale)
    gives zero codes without drawing.  With ``e_out``, ``e_out[i] = v -
    float32(code * unit)``, the residual of the decoded value.  One
    branch-free loop that streams its operands.

    ``floor(a + u)`` is taken as ``floor(y) >> 24`` with ``y = |v| (ratio
    2**24) + r``, ``r = u 2**24`` the 24 random bits: scaling by a power of
    two commutes with float64 rounding here (``ratio`` is at most ``127 /
    2**-149``, ``|v| ratio`` at least ``2**-149 / 3.4e38``: no overflow, no
    subnormal), so ``y = 2**24 fl(a + u)`` exactly, and ``y >= 0``."""
    base = np.uint64(lo)
    if ratio == 0.0:
        zero = np.float32(0.0 * unit)
        for k in range(hi - lo):
            codes[k] = 0
            if e_out is not None:
                i = base + np.uint64(k)
                e_out[i] = _v(x, e, i) - zero
        return
    ratio24 = ratio * _F64_2P24
    z = weyl_cpu(key, base)
    for k in range(hi - lo):
        r = bits24_weyl_cpu(z)
        z += U64_GOLDEN
        i = base + np.uint64(k)
        v = _v(x, e, i)
        y = abs(np.float64(v)) * ratio24 + np.float64(r)
        q = min(np.int64(y) >> 24, levels)
        c = -q if v < 0 else q
        codes[k] = c
        if e_out is not None:
            e_out[i] = v - np.float32(c * unit)


@njit(cache=True, nogil=True)
def qsgd_codes(x, key, offset, ratio, levels, codes):
    """QSGD codes of ``x`` (one bucket, ``ratio = levels / scale``; 0: all
    zero), one per element of ``codes`` (any integer dtype)."""
    _qsgd_block(x, None, None, 0, x.size, key + np.uint64(offset) * U64_GOLDEN, ratio, 0.0,
                levels, codes)


@njit(cache=True, nogil=True)
def _qsgd_encode(x, e, e_out, decoded, rcodes, rscales, rbits, rbucket, rlevels,
                 bucket, bits, levels, use_max, key, offset, scales, packed, contract, omega,
                 omega_last):
    """The one QSGD encoder (see :func:`qsgd_encode`,
    :func:`qsgd_encode_feedback` and :func:`qsgd_owner_step`) of ``v = x + e``
    (``x`` for ``e=None``).

    Walks ``[0, n)`` in blocks of :data:`BLOCK` codes (packed at the end of
    each block) and, within them, bucket by bucket.  When bucket ``j``
    starts, the scale of bucket ``j + 1`` is taken (a streaming pass over
    ``x`` and ``e``; with ``rcodes``, the owner, ``decoded`` -- which is
    ``x`` -- first gets the rank-order sum of the received packets up to that
    bucket's end, a block at a time); bucket ``j``, whose scale is known since
    the previous bucket, then gets its codes, ``e_out = v - decode`` and
    ``decoded = decode`` (those given) -- a second look at ``x`` and ``e``
    that hits cache unless buckets are larger than the cache.  The lookahead
    keeps the scale's latency (lane sums, square root, division) off the code
    loop's path.  Codes are drawn against the bucket's scale ``S``; with
    ``contract`` (error feedback) the packet stores ``float32(S / (1 +
    w))``, which is what decodes and what the residual subtracts, where ``w``
    is the smaller of ``omega`` (``omega_last`` for the last bucket) and
    ``S sum|v| / (L sum(v**2))`` over the bucket (:func:`_bucket_norms`, taken
    with the scale; a finite, positive ``S`` only).  Returns the number of
    non-finite ``v``."""
    n = x.size
    acc = np.zeros(2 * LANES)
    ahead = np.ones(2)  # the contraction factors of buckets j and j + 1
    codes = np.empty(BLOCK, dtype=np.int8)
    tmp = np.empty(BLOCK, dtype=np.int8)
    key = key + np.uint64(offset) * U64_GOLDEN
    nb = scales.size
    bad = 0
    formed = 0          # the owner's sum is formed up to here
    known = 0           # scales[:known] are taken
    j = 0
    bucket_end = 0
    ratio = 0.0
    unit = 0.0
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        i = blo
        while i < bhi:
            if i == bucket_end:
                while known < min(j + 2, nb):
                    lo = known * bucket
                    hi = min(lo + bucket, n)
                    if rcodes is not None:
                        while formed < hi:
                            fhi = min(formed + BLOCK, n)
                            _decode_sum_range(rcodes, rbits, rbucket, rlevels, rscales, formed,
                                              fhi, tmp, decoded[formed:fhi])
                            formed = fhi
                    scale, b = _bucket_scale(x, e, lo, hi, use_max, acc)
                    scales[known] = scale
                    bad += b
                    if contract:
                        w = omega_last if known == nb - 1 else omega
                        if scale > 0 and scale < np.inf:
                            l1, l2 = _bucket_norms(x, e, lo, hi, acc)
                            if l2 > 0:
                                wb = np.float64(scale) * l1 / (levels * l2)
                                w = wb if wb < w else w
                        ahead[known & 1] = 1.0 / (1.0 + w)
                    known += 1
                bucket_end = min(i + bucket, n)
                ratio = _ratio(scales[j], levels)
                if contract:
                    scales[j] = np.float32(np.float64(scales[j]) * ahead[j & 1])
                unit = np.float64(scales[j]) / levels
                j += 1
            seg = min(bucket_end, bhi)
            cb = codes[i - blo:seg - blo]
            _qsgd_block(x, e, e_out, i, seg, key, ratio, unit, levels, cb)
            if decoded is not None:
                _scale_codes(cb, unit, decoded[i:seg], False)
            i = seg
        _pack_block(codes, bhi - blo, bits, packed, (blo * bits) >> 3)
    return bad


@njit(cache=True, nogil=True)
def qsgd_encode(x, bucket, bits, levels, use_max, key, offset, scales, packed, contract=False,
                omega=0.0, omega_last=0.0):
    """QSGD of ``x``: per bucket its scale into ``scales[j]`` (see
    :func:`_bucket_scale`; contracted with ``contract``, see
    :func:`_qsgd_encode`), then its stochastically rounded codes,
    ``bits``-bit packed into ``packed`` (``ceil(n bits / 8)`` bytes)."""
    _qsgd_encode(x, None, None, None, None, None, 0, 1, 1,
                 bucket, bits, levels, use_max, key, offset, scales, packed, contract, omega,
                 omega_last)


@njit(cache=True, nogil=True)
def qsgd_encode_feedback(x, e, bucket, bits, levels, use_max, key, offset, scales, packed,
                         e_out, contract=False, omega=0.0, omega_last=0.0):
    """:func:`qsgd_encode` of ``v = x + e`` (``v = x`` for ``e=None``) and
    ``e_out = v - decode(packet)``, in one pass over ``x`` and ``e`` (each
    bucket read twice, the second time from cache) -- the bits of encode,
    decode and subtract.  Returns the number of non-finite ``v``."""
    return _qsgd_encode(x, e, e_out, None, None, None, 0, 1, 1,
                        bucket, bits, levels, use_max, key, offset, scales, packed, contract,
                        omega, omega_last)


@njit(cache=True, nogil=True)
def qsgd_owner_step(rcodes, rscales, rbits, rbucket, rlevels, e, e_out, out,
                    bucket, bits, levels, use_max, key, offset, scales, packed, contract=False,
                    omega=0.0, omega_last=0.0):
    """The owner stage of ``twoshot`` in one pass: ``acc = 0 +
    decode(packet 0) + decode(packet 1) + ...`` in packet order (rows of
    ``rcodes`` / ``rscales``: the received packets' codes and scales, all with
    ``rbits`` bits, ``rlevels`` levels and buckets of ``rbucket``) into
    ``out``, the packet of ``w = acc + e`` (``acc`` for ``e=None``) into
    ``scales`` / ``packed``, ``e_out = w - decode(packet)`` (with ``e_out``)
    and ``out = decode(packet)``.  The bits of decode-add, compensate,
    re-encode, decode and subtract.  Returns the number of non-finite ``w``."""
    return _qsgd_encode(out, e, e_out, out, strided_rows(rcodes), strided_rows(rscales), rbits,
                        rbucket, rlevels, bucket, bits, levels, use_max, key, offset, scales,
                        packed, contract, omega, omega_last)


@njit(cache=True, nogil=True)
def qsgd_requantize(out, e, e_out, bucket, bits, levels, use_max, key, offset, scales, packed,
                    contract=False, omega=0.0, omega_last=0.0):
    """:func:`qsgd_owner_step` on a sum already formed in ``out`` (the
    received packets decoded and added in rank order by the caller, as
    ``qsgd``'s Elias form does): the packet of ``w = out + e`` (``out`` for
    ``e=None``), ``e_out = w - decode(packet)`` (with ``e_out``) and ``out =
    decode(packet)``.  Returns the number of non-finite ``w``."""
    return _qsgd_encode(out, e, e_out, out, None, None, 0, 1, 1,
                        bucket, bits, levels, use_max, key, offset, scales, packed, contract,
                        omega, omega_last)


@njit(cache=True, nogil=True)
def qsgd_shared_codes(x, bucket, levels, scales, key, offset, codes):
    """QSGD codes against given per-bucket ``scales`` (e.g. MAX-shared across
    ranks), one per element of ``codes``."""
    n = x.size
    for j in range(scales.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        qsgd_codes(x[lo:hi], key, offset + lo, _ratio(scales[j], levels), levels,
                   codes[lo:hi])
