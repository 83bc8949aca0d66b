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

A full block of ``w``-bit codes is exactly ``w`` 64-bit little-endian
words (``64 w`` bits): it is packed through a 64-bit accumulator and
stored/loaded 8 bytes at a time (byte loops LLVM merges into one unaligned
access, so unaligned packets need no copy), and unpacked by reading bits
``k w ..`` across at most two words (``w <= WIDTH_MAX = 50 < 64``) -- or,
where the payload holds 8 more bytes after the block, by one unaligned
8-byte load at the code's first byte (``7 + w <= 64`` bits).  The last,
partial block goes byte by byte.  The codes of a block are computed
in one branch-free pass (``rint`` in the current rounding mode: ties to
even), its width from the OR of its zig-zag codes; a block holding a
non-finite or out-of-range value is scanned again for the counts.  The
kernels run on one thread; the codec validates the widths and the packet
size before any of them reads a payload (they do no bounds checks).
"""
import numpy as np
from numba import njit

from .bitcast import bit_length

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
def _code(v, s):
    """The code of the float32 ``v`` for step ``s``: the integer nearest
    ``v / s`` (ties to even) as a float64 -- the float64 division never
    moves a float32 quotient across a half-integer (the codec's proof);
    NaN for non-finite ``v``."""
    return np.rint(np.float64(v) / s)


@njit(cache=True, nogil=True, inline="always")
def _zigzag(q):
    return _U64((q << 1) ^ (q >> 63))


@njit(cache=True, nogil=True, inline="always")
def _zigzag_f(q):
    """The zig-zag code of the integral float64 ``q`` (``|q| < 2**52``)."""
    return _U64(np.int64(q + q if q >= 0.0 else -(q + q) - 1.0))


@njit(cache=True, nogil=True, inline="always")
def _unzigzag(z):
    return np.int64(z >> _U64(1)) ^ -np.int64(z & _U64(1))


@njit(cache=True, nogil=True, inline="always")
def _value(q, s):
    """``float32(q s)``: one rounding of the exact float64 product."""
    return np.float32(np.float64(q) * s)


@njit(cache=True, nogil=True, inline="always")
def _store64(out, pos, word):
    """``word`` into ``out[pos:pos + 8]``, little-endian (unsigned indices:
    no wraparound test, so LLVM merges the bytes into one store)."""
    p = _U64(pos)
    for j in range(8):
        out[p + _U64(j)] = np.uint8((word >> _U64(8 * j)) & _U64(0xFF))


@njit(cache=True, nogil=True, inline="always")
def _load64(buf, pos):
    """The little-endian 64-bit word at ``buf[pos:pos + 8]`` (one load)."""
    p = _U64(pos)
    word = _U64(0)
    for j in range(8):
        word |= _U64(buf[p + _U64(j)]) << _U64(8 * j)
    return word


@njit(cache=True, nogil=True, inline="always")
def _pack_words(zs, count, w, out, pos):
    """``count`` chunks ``zs[:count]`` of ``w <= 63`` bits (``count w`` a
    multiple of 64) through a 64-bit accumulator, as whole 8-byte words
    into ``out[pos:]``; returns the position after them."""
    uw = _U64(w)
    acc = _U64(0)
    nb = 0
    for k in range(count):
        z = zs[k]
        acc |= z << _U64(nb)
        nb += w
        if nb >= 64:
            _store64(out, pos, acc)
            pos += 8
            nb -= 64
            acc = z >> (uw - _U64(nb))      # the bits not stored; 0 for nb = 0
    return pos


@njit(cache=True, nogil=True, inline="always")
def _pack_block(zs, m, w, out, pos):
    """``m`` zig-zag codes ``zs[:m]`` (each below ``2**w``) at ``w`` bits
    into ``out[pos:]``; returns the position after the block's bytes.  A
    full block first joins 4 (``w <= 15``) or 2 (``w <= 31``) codes into
    one chunk, in place in ``zs``."""
    if w == 0:
        return pos
    if m == BLOCK:      # exactly w words
        if w <= 15:     # 16 groups of 4 codes (4 w <= 60 bits)
            for i in range(BLOCK // 4):
                zs[i] = (zs[4 * i] | (zs[4 * i + 1] << _U64(w))
                         | (zs[4 * i + 2] << _U64(2 * w)) | (zs[4 * i + 3] << _U64(3 * w)))
            return _pack_words(zs, BLOCK // 4, 4 * w, out, pos)
        if w <= 31:     # 32 pairs (2 w <= 62 bits)
            for i in range(BLOCK // 2):
                zs[i] = zs[2 * i] | (zs[2 * i + 1] << _U64(w))
            return _pack_words(zs, BLOCK // 2, 2 * w, out, pos)
        return _pack_words(zs, BLOCK, w, out, pos)
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


@njit(cache=True, nogil=True, inline="always")
def _unpack_block(payload, pos, m, w, zs, wd):
    """``m`` codes of ``w`` bits from ``payload[pos:]`` into ``zs`` (``wd``:
    ``WIDTH_MAX + 1`` words of scratch); returns the position after the
    block's bytes."""
    if w == 0:
        for k in range(m):
            zs[k] = _U64(0)
        return pos
    mask = _U64((1 << w) - 1)
    if m == BLOCK:
        for j in range(w):
            wd[j] = _load64(payload, pos + 8 * j)
        wd[w] = _U64(0)
        for k in range(BLOCK):
            b = k * w
            j = b >> 6
            o = _U64(b & 63)
            lo = wd[j] >> o
            hi = (wd[j + 1] << (_U64(63) - o)) << _U64(1)
            zs[k] = (lo | hi) & mask
        return pos + 8 * w
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


@njit(cache=True, nogil=True, inline="always")
def _scan(x, e, has_e, lo, hi, s, bad, over):
    """The scalar count of :func:`ebq_encode` over ``[lo, hi)``: ``bad``
    plus the non-finite ``v``, ``over`` (if still -1) the first index whose
    code exceeds ``QMAX``."""
    qmax = np.float64(QMAX)
    for i in range(lo, hi):
        v = x[i] + e[i] if has_e else x[i]
        if v - v != 0:
            bad += 1
        elif over < 0 and abs(_code(v, s)) > qmax:
            over = i
    return bad, over


@njit(cache=True, nogil=True, inline="always")
def _encode_loop(x, e, has_e, feedback, s, widths, payload, e_out):
    n = x.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    pos = 0
    bad = 0
    over = -1
    qmax = np.float64(QMAX)
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        zor = _U64(0)
        nok = 0
        for k in range(m):
            i = blo + k
            v = x[i] + e[i] if has_e else x[i]
            q = _code(v, s)
            ok = abs(q) <= qmax         # false for NaN (non-finite v)
            q = q if ok else 0.0
            nok += 0 if ok else 1
            if feedback:
                e_out[i] = v - _value(q, s)
            z = _zigzag_f(q)
            zs[k] = z
            zor |= z
        if nok:
            bad, over = _scan(x, e, has_e, blo, blo + m, s, bad, over)
        w = bit_length(zor)
        widths[c] = w
        pos = _pack_block(zs, m, w, payload, pos)
    return pos, bad, over


# one compiled loop per flag pair (constant flags inside), each compiled on
# its first call: a process compiles only the loops it runs (one is ~3.5 s
# of one core; the four in one function took 13.5 s on every first encode)
@njit(cache=True, nogil=True)
def _encode_x(x, s, widths, payload):
    return _encode_loop(x, x, False, False, s, widths, payload, x)


@njit(cache=True, nogil=True)
def _encode_xe(x, e, s, widths, payload):
    return _encode_loop(x, e, True, False, s, widths, payload, x)


@njit(cache=True, nogil=True)
def _encode_x_feedback(x, s, widths, payload, e_out):
    return _encode_loop(x, x, False, True, s, widths, payload, e_out)


@njit(cache=True, nogil=True)
def _encode_xe_feedback(x, e, s, widths, payload, e_out):
    return _encode_loop(x, e, True, True, s, widths, payload, e_out)


def ebq_encode(x, e, has_e, feedback, s, widths, payload, e_out):
    """Codes of ``v = x + e`` (``v = x`` without ``has_e``), float32 sums,
    block by block: the width of block ``c`` into ``widths[c]``, its packed
    codes into ``payload`` from where the previous block's end; with
    ``feedback`` also ``e_out = v - float32(q s)``.  ``payload`` must hold
    the worst case (width 21).  Returns ``(bytes, bad, over)``: the payload
    bytes written, how many ``v`` are NaN/Inf, and the index of the first
    ``v`` whose code exceeds ``QMAX`` (-1: none).  Non-finite and
    out-of-range entries get code 0; the caller raises for either.  (A
    Python function: it picks the compiled loop of its flags.)"""
    if has_e:
        if feedback:
            return _encode_xe_feedback(x, e, s, widths, payload, e_out)
        return _encode_xe(x, e, s, widths, payload)
    if feedback:
        return _encode_x_feedback(x, s, widths, payload, e_out)
    return _encode_x(x, s, widths, payload)


@njit(cache=True, nogil=True)
def ebq_codes(x, s, codes):
    """``codes[i]`` (int32 or int64) = the code of ``x[i]``; returns
    ``(bad, over)`` as :func:`ebq_encode` (their codes 0)."""
    qmax = np.float64(QMAX)
    nok = 0
    for i in range(x.size):
        q = _code(x[i], s)
        ok = abs(q) <= qmax
        nok += 0 if ok else 1
        codes[i] = np.int64(q if ok else 0.0)
    if nok:
        return _scan(x, x, False, 0, x.size, s, 0, -1)
    return 0, -1


@njit(cache=True, nogil=True, inline="always")
def _unpack_any(payload, pos, m, w, zs, wd):
    """:func:`_unpack_block`, but a full block with 8 more payload bytes
    after it reads each code with one unaligned 8-byte load at its first
    byte (``7 + w <= 64`` bits; the load may reach 8 bytes past the code)."""
    if m == BLOCK and w > 0 and pos + 8 * w + 8 <= payload.size:
        mask = _U64((1 << w) - 1)
        for k in range(BLOCK):
            b = k * w
            zs[k] = (_load64(payload, pos + (b >> 3)) >> _U64(b & 7)) & mask
        return pos + 8 * w
    return _unpack_block(payload, pos, m, w, zs, wd)


@njit(cache=True, nogil=True)
def ebq_decode(widths, payload, s, out, add):
    """``out (+)= float32(q s)`` for the codes of a validated packet (codes
    into a block of scratch, then a loop over it that LLVM vectorises)."""
    n = out.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    wd = np.empty(WIDTH_MAX + 1, dtype=np.uint64)
    pos = 0
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        pos = _unpack_any(payload, pos, m, np.int64(widths[c]), zs, wd)
        ob = out[blo:blo + m]
        if add:
            for k in range(m):
                ob[k] += _value(_unzigzag(zs[k]), s)
        else:
            for k in range(m):
                ob[k] = _value(_unzigzag(zs[k]), s)


@njit(cache=True, nogil=True)
def ebq_add_codes(widths, payload, acc):
    """``acc += q`` (int64) for the codes of a validated packet of
    ``acc.size`` elements."""
    n = acc.size
    zs = np.empty(BLOCK, dtype=np.uint64)
    wd = np.empty(WIDTH_MAX + 1, dtype=np.uint64)
    pos = 0
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        pos = _unpack_any(payload, pos, m, np.int64(widths[c]), zs, wd)
        ab = acc[blo:blo + m]
        for k in range(m):
            ab[k] += _unzigzag(zs[k])


@njit(cache=True, nogil=True)
def ebq_add_residual_codes(e, s, acc, e_out, has_out):
    """Fold a float32 residual ``e`` into integer codes: ``acc += code(e)``
    and (``has_out``) ``e_out = e - float32(code(e) s)``.  Returns ``(bad,
    over)`` as :func:`ebq_codes`."""
    qmax = np.float64(QMAX)
    nok = 0
    for i in range(acc.size):
        v = e[i]
        q = _code(v, s)
        ok = abs(q) <= qmax
        nok += 0 if ok else 1
        q = q if ok else 0.0
        acc[i] += np.int64(q)
        if has_out:
            e_out[i] = v - _value(q, s)
    if nok:
        return _scan(e, e, False, 0, acc.size, s, 0, -1)
    return 0, -1


@njit(cache=True, nogil=True)
def ebq_sizes(acc, widths):
    """Widths of the blocks of the int64 codes ``acc`` into ``widths``;
    returns ``(payload bytes, largest |code|)``."""
    n = acc.size
    total = 0
    big = np.int64(0)
    for c, blo in enumerate(range(0, n, BLOCK)):
        m = min(BLOCK, n - blo)
        zor = _U64(0)
        for k in range(m):
            q = acc[blo + k]
            a = q if q >= 0 else -q
            big = a if a > big else big
            zor |= _zigzag(q)
        w = bit_length(zor)
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
