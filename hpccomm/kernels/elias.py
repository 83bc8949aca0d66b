"""CPU kernels of QSGD's Elias coding (``qsgd`` with ``elias=True``).

They transcode between the fixed-width QSGD codes (``bits``-bit two's
complement, packed LSB first, as :func:`hpccomm.kernels.qsgd.qsgd_encode`
writes them) and the Elias bit streams of :mod:`hpccomm.codecs.qsgd`'s
layout version 2, bucket by bucket; the quantization itself stays in
:mod:`hpccomm.kernels.qsgd`.

Elias-omega code of ``N >= 1`` (Elias 1975): the groups ``bin(N_k) ..
bin(N_1) bin(N)`` then a ``0``, where ``N_1 = bitlen(N) - 1``, ``N_2 =
bitlen(N_1) - 1``, ... down to (excluding) 1; each group written most
significant bit first.  ``omega(1) = "0"``, ``omega(2) = "10 0"``,
``omega(7) = "10 111 0"``.  Its length :func:`omega_length` is
non-decreasing in ``N``.  Streams are MSB first: bit ``k`` of a bucket's
stream is bit ``7 - k mod 8`` of its byte ``k // 8``.

Bucket stream: for each non-zero code ``q_i`` in index order, ``omega(i -
p)`` (``p`` the previous non-zero's index in the bucket, ``-1`` at first),
one sign bit (1: negative) and ``omega(|q_i|)``.  A bucket of ``h``
elements with ``L`` levels takes at most ``h (2 + omega_length(L))`` bits
(every element non-zero at level ``L``: a gap ``g`` costs ``omega_length(g)
<= (g - 1)(2 + omega_length(L)) + 1`` bits, never more than ``g`` unit gaps
with their codes).

Codes up to :data:`TABLE` come from a table of whole codewords (value and
length, built by :func:`omega_table`), so that writing one takes one shift;
larger gaps (buckets beyond :data:`TABLE`) are coded group by group.  The
decoder bounds every read by its bucket's bit count and every value by what
may follow (a gap by the rest of the bucket, a level by ``L``), so malformed
bits end in an error code, never in a read past the packet or an endless loop.
"""
import numpy as np
from numba import njit

from .bitcast import bit_length

#: codewords of 1 .. TABLE - 1 come from the table (at most 27 bits each)
TABLE = 1 << 16

#: error codes of :func:`elias_decode` (0: none)
ERR_TABLE, ERR_OVERRUN, ERR_CODE, ERR_GAP, ERR_LEVEL, ERR_PADDING = 1, 2, 3, 4, 5, 6
ERRORS = {
    ERR_TABLE: "its bit-length table does not add up to the stream's bytes, or an entry "
               "exceeds the bucket's worst case",
    ERR_OVERRUN: "a code runs past the end of its bucket's bits",
    ERR_CODE: "an Elias-omega code is longer than any value it may hold",
    ERR_GAP: "a gap points past the end of its bucket",
    ERR_LEVEL: "a level exceeds the codec's levels",
    ERR_PADDING: "the padding bits after a bucket's stream are not zero",
}


@njit(cache=True, nogil=True)
def omega_length(v):
    """Length in bits of the Elias-omega code of ``v >= 1``."""
    n = 1
    while v > 1:
        b = bit_length(np.uint64(v))
        n += b
        v = b - 1
    return n


@njit(cache=True, nogil=True)
def _omega_code(v):
    """``(code, length)`` of the Elias-omega code of ``v >= 1`` as an integer
    whose ``length`` low bits, most significant first, are the code (at most
    63 bits: every ``v < 2**32``)."""
    code = np.uint64(0)   # the groups written so far (the inner ones), then the 0
    n = 1
    while v > 1:
        b = bit_length(np.uint64(v))
        code |= np.uint64(v) << np.uint64(n)
        n += b
        v = b - 1
    return code, n


@njit(cache=True, nogil=True)
def omega_table(codes, lengths):
    """Fill ``codes[v]`` / ``lengths[v]`` with the Elias-omega codeword of
    ``v`` for ``1 <= v < codes.size`` (entry 0 is unused)."""
    codes[0] = 0
    lengths[0] = 0
    for v in range(1, codes.size):
        c, n = _omega_code(v)
        codes[v] = c
        lengths[v] = n


@njit(cache=True, nogil=True, inline="always")
def _code_at(packed, i, bits):
    """The ``bits``-bit two's complement code of element ``i`` of ``packed``
    (LSB first; ``bits`` divides 8)."""
    p = i * bits
    raw = (np.int64(packed[p >> 3]) >> (p & 7)) & ((1 << bits) - 1)
    return raw - ((raw >> (bits - 1)) << bits)


@njit(cache=True, nogil=True, inline="always")
def _len_of(v, lengths):
    return np.int64(lengths[v]) if v < lengths.size else np.int64(omega_length(v))


@njit(cache=True, nogil=True, inline="always")
def _put(stream, pos, acc, nacc, code, length):
    """Append the ``length`` low bits of ``code`` (``length <= 32``) to the
    MSB-first writer ``(pos, acc, nacc)``; whole bytes go to ``stream``."""
    acc = (acc << np.uint64(length)) | code
    nacc += length
    while nacc >= 8:
        nacc -= 8
        stream[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
        pos += 1
    return pos, acc, nacc


@njit(cache=True, nogil=True, inline="always")
def _put_omega(stream, pos, acc, nacc, v, codes, lengths):
    if v < codes.size:
        return _put(stream, pos, acc, nacc, np.uint64(codes[v]), np.int64(lengths[v]))
    c, m = _omega_code(v)    # up to 63 bits: in two halves
    if m > 32:
        pos, acc, nacc = _put(stream, pos, acc, nacc, c >> np.uint64(32), m - 32)
        return _put(stream, pos, acc, nacc, c & np.uint64(0xFFFFFFFF), 32)
    return _put(stream, pos, acc, nacc, c, m)


#: buckets up to this size take the branch-free encoder: a gap's code (at
#: most ``|omega(1024)|`` = 18 bits), the sign and a level's (at most 13)
#: fit the 64-bit accumulator beside the 31 bits it may hold
FAST_BUCKET = 1024


@njit(cache=True, nogil=True)
def elias_encode(packed, bits, bucket, n, codes, lengths, table, stream):
    """Every bucket's stream from the packed fixed-width codes, in one pass:
    bucket ``j``'s bit count into ``table[j]`` and its bits into ``stream``
    from byte ``sum_{k<j} ceil(table[k] / 8)``, its last byte padded with
    zero bits.  ``stream`` must hold the worst case (``h (2 + |omega(L)|)``
    bits per bucket of ``h``, in whole bytes).  Returns the bytes written.

    Buckets of at most :data:`FAST_BUCKET` go element by element without
    branches on the data: each element appends ``omega(gap) sign
    omega(level)`` (from the codeword table) of length 0 when its code is 0,
    and whole 32-bit words leave the accumulator.  Larger buckets (gaps
    beyond the table) append code by code, skipping bytes of zero codes."""
    per = 8 // bits
    pos = 0
    for j in range(table.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        acc = np.uint64(0)
        nacc = 0
        t = 0
        prev = lo - 1
        if bucket <= FAST_BUCKET:
            for i in range(lo, hi):
                c = _code_at(packed, i, bits)
                a = -c if c < 0 else c
                g = i - prev
                la = np.int64(lengths[a])
                w = (((np.uint64(codes[g]) << np.uint64(1)) | np.uint64(c < 0))
                     << np.uint64(la)) | np.uint64(codes[a])
                m = np.int64(lengths[g]) + 1 + la
                nz = c != 0
                m = m if nz else 0
                w = w if nz else np.uint64(0)
                prev = i if nz else prev
                acc = (acc << np.uint64(m)) | w
                nacc += m
                t += m
                if nacc >= 32:
                    nacc -= 32
                    v = acc >> np.uint64(nacc)
                    stream[pos] = np.uint8((v >> np.uint64(24)) & np.uint64(0xFF))
                    stream[pos + 1] = np.uint8((v >> np.uint64(16)) & np.uint64(0xFF))
                    stream[pos + 2] = np.uint8((v >> np.uint64(8)) & np.uint64(0xFF))
                    stream[pos + 3] = np.uint8(v & np.uint64(0xFF))
                    pos += 4
        else:
            i = lo
            while i < hi:
                if (i % per) == 0 and i + per <= hi and packed[(i * bits) >> 3] == 0:
                    i += per            # a whole byte of zero codes
                    continue
                c = _code_at(packed, i, bits)
                if c != 0:
                    a = -c if c < 0 else c
                    t += _len_of(i - prev, lengths) + 1 + np.int64(lengths[a])
                    pos, acc, nacc = _put_omega(stream, pos, acc, nacc, i - prev, codes,
                                                lengths)
                    pos, acc, nacc = _put(stream, pos, acc, nacc, np.uint64(c < 0), 1)
                    pos, acc, nacc = _put(stream, pos, acc, nacc, np.uint64(codes[a]),
                                          np.int64(lengths[a]))
                    prev = i
                i += 1
        while nacc >= 8:
            nacc -= 8
            stream[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
            pos += 1
        if nacc:
            stream[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
            pos += 1
        table[j] = t
    return pos


@njit(cache=True, nogil=True, inline="always")
def _bit(stream, k):
    return (np.int64(stream[k >> 3]) >> (7 - (k & 7))) & 1


@njit(cache=True, nogil=True, inline="always")
def _read_omega(stream, k, end, limit):
    """``(value, next bit, error)`` of the Elias-omega code at bit ``k`` of
    ``stream``, whose bucket ends at bit ``end``; values above ``limit``
    (``< 2**62``) are refused as soon as a group shows them."""
    v = 1
    while True:
        if k >= end:
            return 0, k, ERR_OVERRUN
        if _bit(stream, k) == 0:
            return v, k + 1, 0
        # a group of v + 1 bits, its leading 1 just read: the value is >= 2**v
        if v >= 62 or (1 << v) > limit:
            return 0, k, ERR_CODE
        if k + v + 1 > end:
            return 0, k, ERR_OVERRUN
        w = 1
        for t in range(1, v + 1):
            w = (w << 1) | _bit(stream, k + t)
        k += v + 1
        v = w


@njit(cache=True, nogil=True)
def elias_decode(stream, table, bucket, n, levels, worst, out):
    """Integer codes (``out``, int8, ``n``) of the Elias streams of
    ``table.size`` buckets, after checking the table: every entry at most
    ``worst`` bits per element of its bucket and the sum of ``ceil(entry /
    8)`` equal to ``stream.size``.  Returns ``(error, bucket)``: 0 when the
    streams are well formed (``out`` then holds the codes), else one of the
    ``ERR_*`` codes and the bucket where it was found (``out`` unspecified).
    Each bucket's bits are read once, bit by bit: the next bit's address
    does not wait for the bits before (a table lookup of whole codes would
    chain every load to the one before and measured slower)."""
    total = 0
    for j in range(table.size):
        h = min(bucket, n - j * bucket)
        t = np.int64(table[j])
        if t > worst * h:
            return ERR_TABLE, j
        total += (t + 7) >> 3
    if total != stream.size:
        return ERR_TABLE, -1
    for i in range(n):
        out[i] = 0
    first = 0   # bucket j's first bit
    for j in range(table.size):
        lo = j * bucket
        h = min(bucket, n - lo)
        k = first
        end = first + np.int64(table[j])
        p = -1
        while k < end:
            g, k, err = _read_omega(stream, k, end, h - 1 - p)
            if err:
                return err, j
            if p + g >= h:      # a value below 2**bitlen(limit) but above the limit
                return ERR_GAP, j
            p += g
            if k >= end:
                return ERR_OVERRUN, j
            neg = _bit(stream, k)
            k += 1
            a, k, err = _read_omega(stream, k, end, levels)
            if err or a > levels:
                return (ERR_LEVEL if err == ERR_CODE or err == 0 else err), j
            out[lo + p] = -a if neg else a
        pad = end & 7
        if pad and (np.int64(stream[end >> 3]) & ((1 << (8 - pad)) - 1)):
            return ERR_PADDING, j
        first = (end + 7) & ~np.int64(7)
    return 0, 0
