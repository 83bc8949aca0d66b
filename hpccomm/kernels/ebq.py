"""CPU kernels of the ``ebq`` codec: error-bounded uniform quantization,
zig-zag codes bit-packed per block of :data:`BLOCK` elements.

The format and the error proof are in :mod:`hpccomm.codecs.ebq`; here only
what the loops do.  ``s`` is the codec's float32 step (at most 4
significant bits), passed as a float64 (exact).

* code of ``v``: ``q = rint(v / s)`` in float64 (ties to even): the
  integer nearest ``v / s``, so ``|q s - v| <= s / 2`` (the codec's proof);
* zig-zag: ``z = (q << 1) ^ (q >> 63)`` (``0, -1, 1, -2, ... -> 0, 1, 2,
  3, ...``), as uint64;
* a block's width ``w`` is the bit length of its largest ``z`` (0 for an
  all-zero block); its codes take ``ceil(len w / 8)`` bytes, element ``k``
  at bits ``k w ..`` of the block's little-endian bit stream (LSB first),
  the padding bits of the last byte zero;
* a code decodes to ``float32(float64(q) * s)``: the product is exact in
  float64 for ``|q| < 2**49`` (``s`` has 4 significant bits), so the value
  is rounded once, to nearest, and is exact for ``|q| <= 2**20``.

The byte streams are written and read one byte at a time through a 64-bit
accumulator (``w <= WIDTH_MAX = 50`` keeps it below 58 bits), so unaligned
packets need no copy.  The kernels run on one thread; the codec validates
the widths and the packet size before any of them reads a payload (they do
no bounds checks).
"""
import numpy as np
from numba import njit

#: elements per block (one width byte each)
BLOCK = 64
#: the largest code magnitude of an encode (worker packets): ``q s`` is then
#: exactly a float32 (``|q| * 15 < 2**24``) -- see :mod:`hpccomm.codecs.ebq`
QMAX = (1 << 20) - 1
#: the widest zig-zag code a packet may carry: owners' sums of codes,
#: ``|q| < 2**49`` (float64 products exact)
WIDTH_MAX = 50
#: the largest code magnitude a packet may carry
QWIRE = (1 << (WIDTH_MAX - 1)) - 1

_U64 = np.uint64


@njit(cache=True, nogil=True, inline="always")
def _rint(y):
    """``y`` rounded to the nearest integer, ties to even (float64)."""
    f = np.floor(y)
    r = y - f
    if r > 0.5 or (r == 0.5 and f - 2.0 * np.floor(0.5 * f) != 0.0):
        f += 1.0
    return f


@njit(cache=True, nogil=True, inline="always")
def _code(v, s):
    """The code of the float32 ``v`` for step ``s``: the integer nearest
    ``v / s`` (ties to even) as a float64 -- the float64 division never
    moves a float32 quotient across a half-integer (the codec's proof);
    NaN for non-finite ``v``."""
    return _rint(np.float64(v) / s)


@njit(cache=True, nogil=True, inline="always")
def _zigzag(q):
    return _U64((q << 1) ^ (q >> 63))


@njit(cache=True, nogil=True, inline="always")
def _unzigzag(z):
    return np.int64(z >> _U64(1)) ^ -np.int64(z & _U64(1))


@njit(cache=True, nogil=True, inline="always")
def _bit_length(z):
    w = 0
    while z != _U64(0):
        z >>= _U64(1)
        w += 1
    return w


@njit(cache=True, nogil=True, inline="always")
def _value(q, s):
    """``float32(q s)``: one rounding of the exact float64 product."""
    return np.float32(np.float64(q) * s)


@njit(cache=True, nogil=True, inline="always")
def _pack_block(zs, m, w, out, pos):
    """``m`` zig-zag codes ``zs[:m]`` at ``w`` bits into ``out[pos:]``;
    returns the position after the block's bytes."""
    if w == 0:
        return pos
    acc = _U64(0)
    nb = 0
    for k in range(m):
        acc |= zs[k] << _U64(nb)
        nb += w
        while nb >= 8:
            out[pos] = np.uint8(acc & _U64(0xFF))
            acc >>= _U64(8)
            nb -= 8
            pos += 1
    if nb > 0:
        out[pos] = np.uint8(acc & _U64(0xFF))
        pos += 1
    return pos


@njit(cache=True, nogil=True)
def ebq_encode(x, e, has_e, feedback, s, widths, payload, e_out):
    """Codes of ``v = x + e`` (``v = x`` without ``has_e``), float32 sums,
    block by block: the width of block ``c`` into ``widths[c]``, its packed
    codes into ``payload`` from where the previous block's end; with
    ``feedback`` also ``e_out = v - float32(q s)``.  ``payload`` must hold
    the worst case (width 21).  Returns ``(bytes, bad, over)``: the payload
    bytes written, how many ``v`` are NaN/Inf, and the index of the first
    ``v`` whose code exceeds ``QMAX`` (-1: none).  Non-finite and
    out-of-range entries get code 0; the caller raises for either."""
    n = x.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    pos = 0
    bad = 0
    over = -1
    qmax = np.float64(QMAX)
    for c, blo in enumerate(range(0, n, BLOCK)):
        bhi = min(blo + BLOCK, n)
        m = bhi - blo
        zmax = _U64(0)
        for k in range(m):
            i = blo + k
            v = x[i] + e[i] if has_e else x[i]
            if v - v != 0:
                bad += 1
                q = 0.0
            else:
                q = _code(v, s)
                if abs(q) > qmax:
                    if over < 0:
                        over = i
                    q = 0.0
            if feedback:
                e_out[i] = v - _value(q, s)
            z = _zigzag(np.int64(q))
            zs[k] = z
            zmax = z if z > zmax else zmax
        w = _bit_length(zmax)
        widths[c] = w
        pos = _pack_block(zs, m, w, payload, pos)
    return pos, bad, over


@njit(cache=True, nogil=True)
def ebq_codes(x, s, codes):
    """``codes[i]`` (int32 or int64) = the code of ``x[i]``; returns
    ``(bad, over)`` as :func:`ebq_encode` (their codes 0)."""
    bad = 0
    over = -1
    qmax = np.float64(QMAX)
    for i in range(x.size):
        v = x[i]
        if v - v != 0:
            bad += 1
            q = 0.0
        else:
            q = _code(v, s)
            if abs(q) > qmax:
                if over < 0:
                    over = i
                q = 0.0
        codes[i] = np.int64(q)
    return bad, over


@njit(cache=True, nogil=True, inline="always")
def _unpack_block(payload, pos, m, w, zs):
    """``m`` codes of ``w`` bits from ``payload[pos:]`` into ``zs``; returns
    the position after the block's bytes."""
    if w == 0:
        for k in range(m):
            zs[k] = _U64(0)
        return pos
    mask = _U64((1 << w) - 1)
    acc = _U64(0)
    nb = 0
    for k in range(m):
        while nb < w:
            acc |= _U64(payload[pos]) << _U64(nb)
            pos += 1
            nb += 8
        zs[k] = acc & mask
        acc >>= _U64(w)
        nb -= w
    return pos


@njit(cache=True, nogil=True)
def ebq_decode(widths, payload, s, out, add):
    """``out (+)= float32(q s)`` for the codes of a validated packet."""
    n = out.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    pos = 0
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        pos = _unpack_block(payload, pos, m, np.int64(widths[c]), zs)
        if add:
            for k in range(m):
                out[blo + k] += _value(_unzigzag(zs[k]), s)
        else:
            for k in range(m):
                out[blo + k] = _value(_unzigzag(zs[k]), s)


@njit(cache=True, nogil=True)
def ebq_add_codes(widths, payload, acc):
    """``acc += q`` (int64) for the codes of a validated packet of
    ``acc.size`` elements."""
    n = acc.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    pos = 0
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        pos = _unpack_block(payload, pos, m, np.int64(widths[c]), zs)
        for k in range(m):
            acc[blo + k] += _unzigzag(zs[k])


@njit(cache=True, nogil=True)
def ebq_add_residual_codes(e, s, acc, e_out, has_out):
    """Fold a float32 residual ``e`` into integer codes: ``acc += code(e)``
    and (``has_out``) ``e_out = e - float32(code(e) s)``.  Returns ``(bad,
    over)`` as :func:`ebq_codes`."""
    bad = 0
    over = -1
    qmax = np.float64(QMAX)
    for i in range(acc.size):
        v = e[i]
        if v - v != 0:
            bad += 1
            q = 0.0
        else:
            q = _code(v, s)
            if abs(q) > qmax:
                if over < 0:
                    over = i
                q = 0.0
        acc[i] += np.int64(q)
        if has_out:
            e_out[i] = v - _value(q, s)
    return bad, over


@njit(cache=True, nogil=True)
def ebq_sizes(acc, widths):
    """Widths of the blocks of the int64 codes ``acc`` into ``widths``;
    returns ``(payload bytes, largest |code|)``."""
    n = acc.size
    total = 0
    big = np.int64(0)
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        zmax = _U64(0)
        for k in range(m):
            q = acc[blo + k]
            a = q if q >= 0 else -q
            big = a if a > big else big
            z = _zigzag(q)
            zmax = z if z > zmax else zmax
        w = _bit_length(zmax)
        widths[c] = w
        total += (m * w + 7) // 8
    return total, big


@njit(cache=True, nogil=True)
def ebq_pack(acc, widths, payload):
    """Pack the int64 codes ``acc`` at the block widths ``widths`` (from
    :func:`ebq_sizes`) into ``payload``; returns the bytes written."""
    n = acc.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    pos = 0
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        for k in range(m):
            zs[k] = _zigzag(acc[blo + k])
        pos = _pack_block(zs, m, np.int64(widths[c]), payload, pos)
    return pos


@njit(cache=True, nogil=True)
def ebq_values(codes, s, out, add):
    """``out (+)= float32(q s)`` for integer codes (int32 or int64)."""
    if add:
        for i in range(out.size):
            out[i] += _value(np.int64(codes[i]), s)
    else:
        for i in range(out.size):
            out[i] = _value(np.int64(codes[i]), s)


@njit(cache=True, nogil=True)
def ebq_first_beyond(x, limit):
    """The first index with ``|x[i]| > limit`` (float64 comparison), or -1;
    NaN compares false."""
    for i in range(x.size):
        if abs(np.float64(x[i])) > limit:
            return i
    return -1
