"""CPU kernels of the ``onebit`` codec: per column, the means of the
non-negative and of the negative entries, and one sign bit per element.

Sign bits are little-endian uint32 words with element ``i`` at bit ``i mod
32`` of word ``i // 32`` (an LSB-first byte stream).  The column sums are
the lane sums of :mod:`.quant_common`; the kernels have a parallel form over
tiles of whole columns (:func:`onebit_encode_tiles`), with the bits of one
thread.  :mod:`hpccomm.kernels.cuda_quantize` produces the same bytes on a
GPU.
"""
import math

import numpy as np
from numba import njit, prange

from .quant_common import BLOCK, LANES, _compensate_block, _lane_total

@njit(cache=True, nogil=True, inline="always")
def _sign_sums(xb, acc):
    """Add the entries of ``xb`` that are ``>= 0`` to lanes ``acc[0:LANES]``
    and the others to ``acc[LANES:2 LANES]``; return how many were ``>= 0``."""
    m = xb.size
    body = m - m % LANES
    npos = 0
    for w in range(body // LANES):
        i0 = w * LANES
        for k in range(LANES):
            v = np.float64(xb[i0 + k])
            p = v >= 0
            pos = v if p else 0.0
            acc[k] += pos
            acc[LANES + k] += v - pos
            npos += np.int64(p)
    for k in range(m - body):
        v = np.float64(xb[body + k])
        p = v >= 0
        pos = v if p else 0.0
        acc[k] += pos
        acc[LANES + k] += v - pos
        npos += np.int64(p)
    return npos


@njit(cache=True, nogil=True, inline="always")
def _sign_sums_from(xb, acc, lane):
    """:func:`_sign_sums` for a piece of a column whose first element falls
    in lane ``lane``: the same lanes, so the same sums, however the column
    is cut into pieces."""
    m = xb.size
    head = min(m, (LANES - lane) % LANES)
    npos = 0
    for k in range(head):
        v = np.float64(xb[k])
        p = v >= 0
        pos = v if p else 0.0
        acc[lane + k] += pos
        acc[LANES + lane + k] += v - pos
        npos += np.int64(p)
    return npos + _sign_sums(xb[head:], acc)


#: ``q * _PACK_MAGIC >> 56`` gathers the low bits of the 8 bytes of ``q``
#: into one byte, byte ``j`` to bit ``j`` (no carries: the products do not overlap)
_PACK_MAGIC = np.uint64(0x0102040810204080)


@njit(cache=True, nogil=True, inline="always")
def _pack_sign_block(v, blo, m, wbytes, flags):
    """Sign bits (``v >= 0``) of ``v[blo:blo + m]`` into the bytes of the
    words (``blo`` a multiple of 8): a compare per element into ``flags``
    (uint8), then 8 flags to a byte with one multiply -- vertical operations
    that vectorize, where a shift-or per bit did not."""
    vb = v[blo:blo + m]
    for k in range(m):
        flags[k] = vb[k] >= 0
    q = flags.view(np.uint64)
    full = m // 8
    base = blo // 8
    wb = wbytes[base:base + full]
    for j in range(full):
        wb[j] = (q[j] * _PACK_MAGIC) >> np.uint64(56)
    if m % 8:
        b = 0
        for k in range(m % 8):
            b |= np.int64(flags[8 * full + k]) << k
        wbytes[base + full] = b


@njit(cache=True, nogil=True)
def _onebit_encode(x, e, has_e, feedback, col_len, means, words, e_out, decoded=None):
    """The one onebit encoder (see :func:`onebit_encode` and
    :func:`onebit_encode_feedback`).  Walks ``[0, n)`` in blocks of
    :data:`BLOCK`: forms ``v`` (into ``e_out`` with ``feedback``), packs its
    signs, adds each column's piece to the column's lane sums; when a column
    ends, writes its means and, with ``feedback``, ``e_out = v - mean`` over
    it (a second look that hits cache unless the column is larger than the
    cache), and ``decoded`` (when given) gets what the packet decodes to.
    Returns the number of non-finite ``v``."""
    n = x.size
    ncols = means.size // 2
    acc = np.zeros(2 * LANES)
    flags = np.zeros(BLOCK, dtype=np.uint8)
    wbytes = words.view(np.uint8)
    src = e_out if feedback else x
    bad = 0
    c = 0
    npos = 0
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        if feedback:
            bad += _compensate_block(x[blo:bhi], e[blo:bhi], has_e, e_out[blo:bhi])
        _pack_sign_block(src, blo, bhi - blo, wbytes, flags)
        pos = blo
        while pos < bhi and c < ncols:
            lo = c * col_len
            hi = min(lo + col_len, n)
            end = min(hi, bhi)
            npos += _sign_sums_from(src[pos:end], acc, (pos - lo) % LANES)
            pos = end
            if end == hi:                      # the column is complete
                mp = np.float32(_lane_total(acc, 0) / max(npos, 1))
                mn = np.float32(_lane_total(acc, LANES) / max(hi - lo - npos, 1))
                means[2 * c] = mp
                means[2 * c + 1] = mn
                if not feedback and decoded is not None:   # (in place when decoded is x)
                    col = src[lo:hi]
                    dcol = decoded[lo:hi]
                    for k in range(hi - lo):
                        dcol[k] = mp if col[k] >= 0 else mn
                if feedback:
                    col = e_out[lo:hi]
                    if decoded is None:
                        for k in range(hi - lo):
                            v = col[k]
                            col[k] = v - (mp if v >= 0 else mn)
                    else:
                        dcol = decoded[lo:hi]
                        for k in range(hi - lo):
                            v = col[k]
                            d = mp if v >= 0 else mn
                            dcol[k] = d
                            col[k] = v - d
                acc[:] = 0.0
                npos = 0
                c += 1
    tail = (n + 7) // 8                        # unused bytes of the last word are 0
    for j in range(tail, 4 * words.size):
        wbytes[j] = 0
    return bad


@njit(cache=True, nogil=True)
def onebit_encode(x, col_len, means, words):
    """Sign bits and per-column means of ``x``, reading ``x`` once.

    Columns are the runs ``[c H, min((c + 1) H, n))``, ``H = col_len``.
    ``means[2c]`` gets the mean of the column's entries ``>= 0`` and
    ``means[2c + 1]`` the mean of its entries ``< 0`` (0 for an empty class):
    float64 lane sums (element ``i`` in lane ``(i - c H) mod LANES``) divided
    by the count, rounded once to float32.  ``words`` (uint32,
    ``ceil(n / 32)``) gets bit ``i mod 32`` of word ``i // 32`` set iff
    ``x[i] >= 0``; unused bits of the last word are 0.
    """
    _onebit_encode(x, x, False, False, col_len, means, words, x)


@njit(cache=True, nogil=True)
def onebit_encode_feedback(x, e, has_e, col_len, means, words, e_out):
    """:func:`onebit_encode` of ``v = x + e`` (``v = x`` without ``has_e``)
    and the new residual ``e_out = v - decode(packet)``, in one pass over
    ``x`` and ``e`` (``v`` lives in ``e_out`` until its column's means are
    known) -- the same bits as encoding, decoding and subtracting.  Returns
    the number of non-finite ``v`` (``e_out`` is then meaningless)."""
    return _onebit_encode(x, e, has_e, True, col_len, means, words, e_out)


@njit(cache=True, nogil=True)
def onebit_decode_sum(means, words, col_len, out):
    """``out = 0 + decode(packet 0) + decode(packet 1) + ...`` in packet
    order, float32: the bits of zeroing ``out`` and adding each packet with
    :func:`onebit_decode`.  The first packet is stored rather than added to
    zero: its values are column means, never -0.0, and ``0.0 + d == d`` for
    every other float32 (a NaN mean is already quiet).  ``means`` (P x 2C)
    and ``words`` (P x ceil(n/32)) hold the packets' fields, all with the
    column length ``col_len``."""
    for src in range(means.shape[0]):
        onebit_decode(words[src], means[src], col_len, out, src > 0)


@njit(cache=True, nogil=True)
def onebit_owner_step(acc, e, has_e, feedback, col_len, means, words, e_out, decoded):
    """The owner stage of ``twoshot`` on a summed chunk ``acc`` (from
    :func:`onebit_decode_sum`): ``w = acc + e`` (``acc`` without ``has_e``)
    into ``e_out``, the packet of ``w`` into ``means`` / ``words``, ``e_out =
    w - decode(packet)`` (the owner's new residual; without ``feedback``
    neither is written and ``w = acc``) and ``decoded`` = what the packet
    decodes to (this rank's slice of the result; it may be ``acc`` itself:
    each column of ``acc`` is read before it is written).  Returns the number
    of non-finite ``w``."""
    return _onebit_encode(acc, e, has_e, feedback, col_len, means, words, e_out, decoded)


#: single-bit masks: ``w & _BITS[k]`` with a constant ``k`` per unrolled lane
#: vectorizes (compare + blend), where ``(w >> k) & 1`` did not
_BITS = np.array([1 << k for k in range(32)], dtype=np.uint32)


@njit(cache=True, nogil=True)
def onebit_decode(words, means, col_len, out, add):
    """``out[i] = means[2c]`` if bit ``i`` is set, else ``means[2c + 1]``
    (``c = i // col_len``); ``add``: ``out +=``.

    Whole words go through the vectorizable forms: a select per lane for
    ``add``, and for stores an integer blend of the two means' bit patterns
    (``bn ^ ((bp ^ bn) & -bit)``: exactly one of the two floats, no
    arithmetic)."""
    n = out.size
    bits = _BITS
    ob = out.view(np.uint32)
    mb = means.view(np.uint32)
    for c in range(means.size // 2):
        lo = c * col_len
        hi = min(lo + col_len, n)
        mp = means[2 * c]
        mn = means[2 * c + 1]
        bp = mb[2 * c]
        bn = mb[2 * c + 1]
        diff = bp ^ bn
        i = lo
        while i < hi and ((i & 31) != 0 or i + 32 > hi):
            v = mp if (np.int64(words[i >> 5]) >> np.int64(i & 31)) & 1 else mn
            if add:
                out[i] += v
            else:
                out[i] = v
            i += 1
        while i + 32 <= hi:
            w = words[i >> 5]
            if add:
                o = out[i:i + 32]
                for k in range(32):
                    o[k] += mp if (w & bits[k]) != 0 else mn
            else:
                o = ob[i:i + 32]
                for k in range(32):
                    o[k] = bn ^ (diff & (np.uint32(0) - ((w & bits[k]) != 0)))
            i += 32
        while i < hi:
            v = mp if (np.int64(words[i >> 5]) >> np.int64(i & 31)) & 1 else mn
            if add:
                out[i] += v
            else:
                out[i] = v
            i += 1


# ---------------------------------------------------------------------------
# onebit, several threads: tiles of whole columns
# ---------------------------------------------------------------------------
#: elements per tile of the parallel onebit kernels (at least; whole columns)
TILE = 1 << 16


def onebit_tile_columns(col_len: int) -> int:
    """Columns per tile of the parallel onebit kernels: at least :data:`TILE`
    elements, and a multiple of 32 elements so that a tile owns whole sign
    words.  Fixed by the data, not by the thread count: every column is
    encoded by the one-thread code, so the bits are those of one thread."""
    cols = max(1, -(-TILE // col_len))
    step = 32 // math.gcd(col_len, 32)
    return -(-cols // step) * step


@njit(cache=True, nogil=True, inline="always")
def _tile(t, tile_cols, ncols, col_len, n, nwords):
    """Columns ``[c0, c1)``, elements ``[lo, hi)`` and words ``[w0, w1)`` of
    tile ``t`` (the last tile takes the words to the end)."""
    c0 = t * tile_cols
    c1 = min(c0 + tile_cols, ncols)
    lo = c0 * col_len
    hi = min(c1 * col_len, n)
    w1 = nwords if c1 == ncols else hi // 32
    return c0, c1, lo, hi, lo // 32, w1


@njit(cache=True, nogil=True, parallel=True)
def onebit_encode_tiles(x, e, has_e, feedback, col_len, means, words, e_out, decoded,
                        tile_cols):
    """:func:`_onebit_encode` tile by tile on several threads (``decoded``
    may be None); returns the number of non-finite values, as it does."""
    n = x.size
    ncols = means.size // 2
    bad = 0
    for t in prange((ncols + tile_cols - 1) // tile_cols):
        c0, c1, lo, hi, w0, w1 = _tile(t, tile_cols, ncols, col_len, n, words.size)
        if decoded is None:
            bad += _onebit_encode(x[lo:hi], e[lo:hi], has_e, feedback, col_len,
                                  means[2 * c0:2 * c1], words[w0:w1], e_out[lo:hi])
        else:
            bad += _onebit_encode(x[lo:hi], e[lo:hi], has_e, feedback, col_len,
                                  means[2 * c0:2 * c1], words[w0:w1], e_out[lo:hi],
                                  decoded[lo:hi])
    return bad


@njit(cache=True, nogil=True, parallel=True)
def onebit_decode_tiles(words, means, col_len, out, add, tile_cols):
    """:func:`onebit_decode` tile by tile on several threads."""
    n = out.size
    ncols = means.size // 2
    for t in prange((ncols + tile_cols - 1) // tile_cols):
        c0, c1, lo, hi, w0, w1 = _tile(t, tile_cols, ncols, col_len, n, words.size)
        onebit_decode(words[w0:w1], means[2 * c0:2 * c1], col_len, out[lo:hi], add)


@njit(cache=True, nogil=True, parallel=True)
def onebit_decode_sum_tiles(means, words, col_len, out, tile_cols):
    """:func:`onebit_decode_sum` tile by tile on several threads (every
    tile adds the packets in packet order)."""
    n = out.size
    ncols = means.shape[1] // 2
    for t in prange((ncols + tile_cols - 1) // tile_cols):
        c0, c1, lo, hi, w0, w1 = _tile(t, tile_cols, ncols, col_len, n, words.shape[1])
        for src in range(means.shape[0]):
            onebit_decode(words[src, w0:w1], means[src, 2 * c0:2 * c1], col_len, out[lo:hi],
                          src > 0)
