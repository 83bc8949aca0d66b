"""CPU kernels of the ``terngrad`` codec: the scale's moments, stochastic
ternary codes, and the owner step.

* random numbers: element ``i`` of the encoded vector draws
  ``u_i = uniform01(key, offset + i)`` (:mod:`hpccomm.kernels.rng`);
* TernGrad keeps element ``i`` with probability ``min(|x_i|, t) / s``, decided
  in float32 as ``u_i * s < min(|x_i|, t)`` (one rounding, no division);
* the codes are 2-bit codes of :mod:`.bitcodes`.

Sums are the lane sums of :mod:`.quant_common`.
:mod:`hpccomm.kernels.cuda_quantize` produces the same bytes on a GPU.
"""
import numpy as np
from numba import njit

from .bitcodes import _decode_sum_range, _pack_block
from .prefetch import prefetch_ahead
from .quant_common import (BLOCK, LANES, ROWS, _count_nonfinite, _lane_total, _row_split, _v,
                           strided_rows)
from .rng import U64_GOLDEN, uniform01_weyl_cpu, weyl_cpu

_U0 = np.uint64(0)


@njit(cache=True, nogil=True, inline="always")
def _tern_moment_rows(x, e, lo, rows, lanes, x0, mx, acc):
    """:func:`_tern_moments` of ``rows`` rows of ``lanes`` elements (rows of
    :data:`LANES`) from ``lo``."""
    base = np.uint64(lo)
    for k in range(lanes):
        a_max = mx[k]
        s1 = acc[k]
        s2 = acc[LANES + k]
        l1 = acc[2 * LANES + k]
        for r in range(rows):
            v = _v(x, e, base + np.uint64(r * LANES + k))
            a = abs(v)
            a_max = a if a > a_max else a_max
            d = np.float64(v) - x0
            s1 += d
            s2 += d * d
            l1 += np.float64(a)
        mx[k] = a_max
        acc[k] = s1
        acc[LANES + k] = s2
        acc[2 * LANES + k] = l1


@njit(cache=True, nogil=True, inline="always")
def _tern_moments(x, e, lo, hi, x0, mx, acc):
    """Add ``v = x + e`` (``x`` for ``e=None``) over ``[lo, hi)`` (``lo`` a
    multiple of :data:`LANES`) to the lanes of ``max |v|`` (``mx``, float32)
    and of ``v - x0``, ``(v - x0)**2`` and ``|v|`` (``acc``, float64), each
    lane in index order; :data:`ROWS` rows at a time so that the lane loop
    vectorizes."""
    full, body = _row_split(hi - lo)
    g = ROWS * LANES
    for r0 in range(0, full, g):
        prefetch_ahead(x, e, lo + r0, lo + r0 + g)
        _tern_moment_rows(x, e, lo + r0, ROWS, LANES, x0, mx, acc)
    _tern_moment_rows(x, e, lo + full, (body - full) // LANES, LANES, x0, mx, acc)
    _tern_moment_rows(x, e, lo + body, 1, hi - lo - body, x0, mx, acc)


@njit(cache=True, nogil=True, inline="always")
def _tern_totals(n, x0, mx, acc):
    """``(max|v|, S1, S2, L1, L2)`` from the lanes of :func:`_tern_moments`:
    ``L2 = sum(v**2) = S2 + x0 (2 S1 + n x0)``, at least ``max|v|**2``
    (which it is in exact arithmetic; the floor keeps rounding from taking
    it below)."""
    s1 = _lane_total(acc, 0)
    s2 = _lane_total(acc, LANES)
    l1 = _lane_total(acc, 2 * LANES)
    top = mx.max()
    l2 = s2 + x0 * (2.0 * s1 + n * x0)
    floor = np.float64(top) * np.float64(top)
    return top, s1, s2, l1, (l2 if l2 > floor else floor)


@njit(cache=True, nogil=True)
def tern_stats(x, e=None):
    """``(max|v|, S1, S2, L1, L2, bad)`` of ``v = x + e`` (``v = x`` for
    ``e=None``): ``S1 = sum(v - v[0])`` and ``S2 = sum((v - v[0])**2)`` in
    float64 lanes (shifted sums: exactly zero variance for constant input),
    ``L1 = sum|v|`` in the same lanes and ``L2 = sum(v**2)`` from them
    (:func:`_tern_totals`; error feedback's contraction factor uses both),
    and ``bad``, the number of non-finite ``v``.  A NaN anywhere makes ``S1``
    NaN; ``max|v|`` ignores NaN.  One streaming pass over ``x`` and ``e``
    (and a count only when ``S1`` or ``S2`` is not finite: float32 values
    cannot overflow the float64 sums, so they are finite exactly when every
    ``v`` is)."""
    n = x.size
    if n == 0:
        return np.float32(0.0), 0.0, 0.0, 0.0, 0.0, 0
    mx = np.zeros(LANES, dtype=np.float32)
    acc = np.zeros(3 * LANES)
    x0 = np.float64(_v(x, e, _U0))
    _tern_moments(x, e, 0, n, x0, mx, acc)
    top, s1, s2, l1, l2 = _tern_totals(n, x0, mx, acc)
    bad = 0 if np.isfinite(s1) and np.isfinite(s2) else _count_nonfinite(x, e, 0, n)
    return top, s1, s2, l1, l2, bad


def owner_accumulator():
    """The running state of :func:`tern_owner_add` over one owner chunk:
    ``(x0, mx, acc)``, the shift ``v[0]`` (set by the piece at 0) and the
    lanes of :func:`_tern_moments`."""
    return np.zeros(1), np.zeros(LANES, dtype=np.float32), np.zeros(3 * LANES)


@njit(cache=True, nogil=True)
def tern_owner_add(rcodes, rscales, e, out, lo, hi, x0, mx, acc):
    """Pass 1 of TernGrad's owner step over the piece ``[lo, hi)`` of the
    owner's chunk (``lo`` a multiple of :data:`BLOCK`; pieces in order, the
    one at 0 first): ``out[lo:hi] = 0 + decode(packet 0) + decode(packet 1)
    + ...`` in packet order (row ``src`` of ``rcodes``: a packet's 2-bit codes
    of the piece, ``rscales[src, 0]`` its scale), and the moments of ``w =
    out + e`` (``out`` for ``e=None``; both the whole chunk) added to the
    lanes of ``(x0, mx, acc)`` (:func:`owner_accumulator`), a block at a time.
    Each lane adds its elements in index order whatever the pieces, so the
    pieces of a chunk give the bits of the chunk in one piece."""
    _tern_owner_add(strided_rows(rcodes), strided_rows(rscales), e, out, lo, hi, x0, mx, acc)


@njit(cache=True, nogil=True)
def _tern_owner_add(rcodes, rscales, e, out, lo, hi, x0, mx, acc):
    """:func:`tern_owner_add` on strided rows (one body for both layouts)."""
    m = hi - lo
    codes = np.empty(BLOCK, dtype=np.int8)
    for blo in range(lo, hi, BLOCK):
        bhi = min(blo + BLOCK, hi)
        _decode_sum_range(rcodes, 2, m, 1, rscales, blo - lo, bhi - lo, codes, out[blo:bhi])
        if blo == 0:
            x0[0] = np.float64(_v(out, e, _U0))
        _tern_moments(out, e, blo, bhi, x0[0], mx, acc)


@njit(cache=True, nogil=True)
def tern_owner_total(x0, mx, acc, e, out):
    """``(max|w|, S1, S2, L1, L2, bad)`` of the whole chunk from the lanes
    :func:`tern_owner_add` filled (as :func:`tern_stats` gives them)."""
    n = out.size
    if n == 0:
        return np.float32(0.0), 0.0, 0.0, 0.0, 0.0, 0
    top, s1, s2, l1, l2 = _tern_totals(n, x0[0], mx, acc)
    bad = 0 if np.isfinite(s1) and np.isfinite(s2) else _count_nonfinite(out, e, 0, n)
    return top, s1, s2, l1, l2, bad


@njit(cache=True, nogil=True, inline="always")
def _tern_code(v, u, scale, clip):
    """The ternary code as a float32 in {-1, 0, 1}: ``sign(v)`` if ``u * scale
    < min(|v|, clip)`` else 0.  Branch-free, in float32 lanes: a kept ``v`` is
    neither zero nor NaN (``u * scale >= 0``), so its sign is ``v < 0``."""
    t = np.float32(1.0) - np.float32(2.0) * np.float32(v < 0)
    return t if u * scale < min(abs(v), clip) else np.float32(0.0)


@njit(cache=True, nogil=True, inline="always")
def _tern_block(x, e, e_out, lo, hi, key, scale, clip, unit, codes):
    """``codes[i - lo]`` for ``i`` in ``[lo, hi)``: the ternary code (see
    :func:`tern_codes`) of ``v = x[i] + e[i]`` (``x[i]`` for ``e=None``) drawn
    with ``uniform01(key, i)``; with ``e_out``, ``e_out[i] = v - t * unit``
    in float32 -- exactly ``v - float32(t * float64(unit))``, the decoded
    value for ``t`` in {-1, 0, 1} when the packet's scale is ``unit``
    (``scale``, or error feedback's contracted one).  One branch-free loop that streams its
    operands: the hash in 64-bit lanes (the counter advanced by addition),
    the rest in float32 lanes."""
    base = np.uint64(lo)
    z = weyl_cpu(key, base)
    for k in range(hi - lo):
        u = uniform01_weyl_cpu(z)
        z += U64_GOLDEN
        i = base + np.uint64(k)
        v = _v(x, e, i)
        t = _tern_code(v, u, scale, clip)
        codes[k] = np.int32(t)
        if e_out is not None:
            e_out[i] = v - t * unit


@njit(cache=True, nogil=True)
def tern_codes(x, key, offset, scale, clip, codes):
    """Stochastic ternary codes, one per element of ``codes`` (any integer
    dtype): ``sign(x_i)`` if ``u_i * scale < min(|x_i|, clip)`` else 0, in
    float32 arithmetic."""
    _tern_block(x, None, None, 0, x.size, key + np.uint64(offset) * U64_GOLDEN, scale, clip,
                scale, codes)


@njit(cache=True, nogil=True)
def tern_encode(x, e, key, offset, scale, clip, unit, packed, e_out=None, decoded=None):
    """The codes of :func:`tern_codes` for ``v = x + e`` (``v = x`` for
    ``e=None``), 2-bit packed into ``packed`` (``ceil(n / 4)`` bytes), for a
    packet whose scale is ``unit`` (float32; ``scale`` itself unless error
    feedback contracts it); with ``e_out``, ``e_out = v - decode``; with
    ``decoded``, ``decoded = decode`` (it may be ``x`` itself: each block is
    read before it is written).  A block of :data:`BLOCK` at a time: codes
    and residual in one streaming loop (:func:`_tern_block`), the decoded
    values, the pack."""
    n = x.size
    codes = np.empty(BLOCK, dtype=np.int8)
    key = key + np.uint64(offset) * U64_GOLDEN
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        m = bhi - blo
        _tern_block(x, e, e_out, blo, bhi, key, scale, clip, unit, codes)
        if decoded is not None:
            db = decoded[blo:bhi]
            for k in range(m):
                db[k] = np.float32(codes[k]) * unit
        _pack_block(codes, m, 2, packed, blo >> 2)


@njit(cache=True, nogil=True)
def tern_pack(x, key, offset, scale, clip, packed):
    """The codes of :func:`tern_codes`, 2-bit packed into ``packed``
    (``ceil(n / 4)`` bytes)."""
    tern_encode(x, None, key, offset, scale, clip, scale, packed)
