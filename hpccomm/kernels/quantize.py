"""CPU kernels of the quantizing codecs: fp16, bf16, onebit, terngrad, qsgd.

numba ``@njit(cache=True, nogil=True)`` loops over flat, contiguous arrays.  The codecs in
:mod:`hpccomm.codecs` validate every size and header field before calling
them: the kernels do no bounds checks.

Conventions shared with :mod:`hpccomm.kernels.cuda_quantize` (which produces the same
bytes):

* random numbers: element ``i`` of the encoded vector draws
  ``u_i = uniform01(key, offset + i)`` (:mod:`hpccomm.kernels.rng`);
* TernGrad keeps element ``i`` with probability ``min(|x_i|, t) / s``, decided
  in float32 as ``u_i * s < min(|x_i|, t)`` (one rounding, no division);
* QSGD takes ``a_i = |x_i| * (L / scale)`` in float64 (``L`` levels, the
  product rounded before the sum) and level ``min(floor(a_i + u_i), L)``:
  ``floor(a_i) + 1`` with probability ``a_i - floor(a_i)``.  A bucket whose
  scale is zero or not finite gets all-zero codes;
* ``b``-bit codes (``b`` in 2, 4, 8) are two's complement, packed LSB first:
  element ``i`` takes bits ``(i b) mod 8 ..`` of byte ``(i b) // 8``; sign
  bits are little-endian uint32 words with element ``i`` at bit ``i mod 32``
  of word ``i // 32`` (the same LSB-first byte stream);
* a code ``q`` with scale ``S`` and ``L`` levels decodes to
  ``float32(q * (float64(S) / L))``.

Floating-point sums (column means, bucket norms, moments) are float64 partial
sums in :data:`LANES` lanes -- element ``i`` of a range starting at ``lo`` goes
to lane ``(i - lo) mod LANES`` -- combined by the fixed pairwise tree of
:func:`_lane_total`.  The order is fixed, so results depend on the data alone
(not on threads or on the machine), and the lanes let LLVM vectorize.

Performance notes: the kernels run on one thread, except onebit's, which
have a parallel form over tiles of whole columns (:func:`onebit_encode_tiles`,
the same bits on any thread count); encoders
read the input once where the format allows (TernGrad needs its scale first:
two passes), working block by block through small L1-resident scratch
arrays.  Hot loops index slices with ``range`` variables, or with uint64, so
that numba emits no negative-index wraparound (which defeats vectorization).
Packing through uint16 / uint32 views of the scratch assumes a little-endian
host.  The fp16 / bf16 conversions are branch-free selects on uint32 bit
patterns (floats reinterpreted with :mod:`hpccomm.kernels.bitcast`), every
intermediate cast back to uint32 so that the lanes stay 32 bits wide; numba
has no float16 conversion in nopython mode.

What makes the loops vectorize (LLVM's loop vectorizer; numba runs no
SLP vectorizer, so a loop that LLVM unrolls fully stays scalar):

* the random counter ``key + (i + 1) GOLDEN`` is advanced by one addition per
  element (:func:`~hpccomm.kernels.rng.weyl`), not recomputed with a multiply:
  the hash (two 64-bit multiplies, ``vpmullq``) is still about half of the
  vector instructions of TernGrad's and QSGD's code loops;
* element loops are branch-free (selects, float32 lanes for TernGrad's code,
  QSGD's ``floor(a + u)`` as an integer shift of ``|v| ratio 2**24 + r``)
  and read ``x`` and ``e`` straight from memory while they compute, which
  overlaps memory and arithmetic better than a copy into scratch first;
* lane sums take :data:`ROWS` rows per step of the lane loop, which LLVM
  then vectorizes across lanes instead of unrolling it; counts of
  non-finite values are taken only when a sum comes out non-finite;
* read-only passes prefetch 4 KiB ahead (:mod:`hpccomm.kernels.prefetch`);
  QSGD takes each bucket's scale one bucket ahead of its codes, which read
  the bucket again from cache;
* the unpacking of ``b``-bit codes spreads bytes into words and
  sign-extends all their bytes at once.

Measured on one core of the development machine (Sapphire Rapids, 64 MiB of
float32): encode with error feedback at ~55 % (TernGrad: two passes) and
~60 % (QSGD) of the memory floor of ``bench codecs`` -- against ~18 % for
the three steps before -- and the fused owner steps ~4x faster than decode-add,
compensate, re-encode, decode and subtract.  Only the stores of the residual
are left to the write-allocate path (non-temporal stores did not survive
LLVM's vectorizer).
"""
import math

import numpy as np
from numba import njit, prange

from .bitcast import f32_as_u32, u32_as_f32
from .prefetch import prefetch_ahead
from .rng import U64_GOLDEN, bits24_weyl_cpu, uniform01_weyl_cpu, weyl_cpu

#: float64 partial sums per reduction (see the module docstring)
LANES = 32
#: elements per block of the blocked encoders (a multiple of 32)
BLOCK = 4096
#: rows of :data:`LANES` elements per step of the lane sums: the lane loop
#: then holds ``ROWS`` sequential adds per lane, too large for LLVM to unroll
#: it fully (numba runs no SLP vectorizer, so a fully unrolled loop stays
#: scalar) -- it vectorizes across the lanes instead, in the same order
ROWS = 8
F32_MAX = float(np.finfo(np.float32).max)

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U5 = np.uint64(5)
_U31 = np.uint64(31)
_U32 = np.uint64(32)


@njit(cache=True, nogil=True, inline="always")
def _lane_total(acc, start):
    """Sum of ``acc[start:start + LANES]`` as a fixed pairwise tree (lane
    ``k`` += lane ``k + w`` for ``w`` = 16, 8, 4, 2, 1); clobbers the lanes."""
    w = LANES // 2
    while w >= 1:
        for k in range(w):
            acc[start + k] += acc[start + k + w]
        w //= 2
    return acc[start]


# ---------------------------------------------------------------------------
# fp16 / bf16
# ---------------------------------------------------------------------------
_U32 = np.uint32


@njit(cache=True, nogil=True, inline="always")
def _f16_bits(w):
    """The binary16 bit pattern (as uint32) of the float32 with bit pattern
    ``w``, rounded to nearest even; finite values that would round to
    ``|h| >= 65520`` saturate to +-65504; +-inf stay infinite; NaN becomes a
    quiet NaN of the same sign keeping the top 9 payload bits.

    Branch-free (selects), in 32-bit lanes: every intermediate is cast back
    to uint32 because numba widens uint32 arithmetic to 64 bits, which halves
    the lanes.  Half subnormals (``|v| < 2**-14``) come from one float
    addition: ``0.5 + |v|`` rounds ``|v|`` to a multiple of ``2**-24`` (the
    float32 spacing at 0.5), ties to even, and its bits minus those of 0.5
    count the multiples.  That holds under flush-to-zero / denormals-are-zero
    modes too: the sum is normal, and a float32 subnormal read as zero
    rounds to 0 either way.  Normal halves re-bias the exponent (127 -> 15)
    and round away the 13 low bits: ``+ 0xFFF`` plus the kept low bit, then
    a shift."""
    a = _U32(w & _U32(0x7FFFFFFF))
    sub = _U32(f32_as_u32(u32_as_f32(a) + np.float32(0.5)) - _U32(0x3F000000))
    norm = _U32(_U32(_U32(a - _U32(0x37FFF001)) + _U32(_U32(a >> _U32(13)) & _U32(1)))
                >> _U32(13))
    h = sub if a < _U32(0x38800000) else norm           # below 2**-14: subnormal half
    h = _U32(0x7BFF) if a >= _U32(0x477FF000) else h    # rounds to >= 65520: saturate
    special = _U32(_U32(_U32(0x7C00) | _U32(_U32(a >> _U32(13)) & _U32(0x3FF)))
                   | _U32(_U32(a > _U32(0x7F800000)) << _U32(9)))
    h = special if a >= _U32(0x7F800000) else h         # inf, or NaN made quiet
    return _U32(h | _U32(_U32(w >> _U32(16)) & _U32(0x8000)))


@njit(cache=True, nogil=True, inline="always")
def _f16_value(h):
    """The float32 value of the binary16 bit pattern ``h`` (exact): normals
    by re-biasing the exponent, subnormals as ``m * 2**-24``, +-inf, and
    NaN as the canonical quiet NaN ``0x7FC00000`` with ``h``'s sign.
    Branch-free, 32-bit lanes (see :func:`_f16_bits`)."""
    b = _U32(h)
    m = _U32(b & _U32(0x7FFF))
    r = _U32(_U32(m << _U32(13)) + _U32(0x38000000))
    r = f32_as_u32(np.float32(m) * np.float32(2.0 ** -24)) if m < _U32(0x400) else r
    r = (_U32(0x7F800000) if m == _U32(0x7C00) else _U32(0x7FC00000)) if m >= _U32(0x7C00) else r
    return u32_as_f32(_U32(r | _U32(_U32(b & _U32(0x8000)) << _U32(16))))


@njit(cache=True, nogil=True)
def f32_to_f16(u, out):
    """float32 bit patterns ``u`` (uint32) -> IEEE half bit patterns
    (uint16), rounding to nearest even.  Finite values beyond the half range
    saturate to +-65504; +-inf stay infinite; NaN becomes a quiet NaN of the
    same sign (:func:`_f16_bits`)."""
    for i in range(u.size):
        out[i] = _f16_bits(u[i])


@njit(cache=True, nogil=True)
def f16_to_f32(h, out, add):
    """IEEE half bit patterns (uint16) -> float32 (exact, NaN canonical:
    :func:`_f16_value`); ``add``: ``out +=``."""
    if add:
        for i in range(h.size):
            out[i] += _f16_value(h[i])
    else:
        for i in range(h.size):
            out[i] = _f16_value(h[i])


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(w, saturate):
    """The bfloat16 bit pattern (as uint32) of the float32 with bit pattern
    ``w``: nearest even; NaN becomes a quiet NaN of the same sign; with
    ``saturate`` finite values that would round to infinity become the
    largest bfloat16.  Branch-free, 32-bit lanes (see :func:`_f16_bits`;
    the sum wraps only for NaN patterns, which the select replaces)."""
    a = _U32(w & _U32(0x7FFFFFFF))
    top = _U32(w >> _U32(16))
    h = _U32(_U32(_U32(w + _U32(0x7FFF)) + _U32(top & _U32(1))) >> _U32(16))
    h = _U32(top | _U32(0x40)) if a > _U32(0x7F800000) else h
    if saturate:
        big = (a >= _U32(0x7F7F8000)) & (a < _U32(0x7F800000))
        h = _U32(_U32(top & _U32(0x8000)) | _U32(0x7F7F)) if big else h
    return h


@njit(cache=True, nogil=True)
def f32_to_bf16(u, out, saturate):
    """float32 bit patterns (uint32) -> bfloat16 bit patterns (uint16),
    nearest even; NaN becomes a quiet NaN of the same sign.  With
    ``saturate`` (the codec) finite values that would round to infinity
    become the largest bfloat16 (+-3.3895e38); without (a user's bfloat16
    result) they round to infinity, as IEEE rounding does
    (:func:`_bf16_bits`)."""
    if saturate:
        for i in range(u.size):
            out[i] = _bf16_bits(u[i], True)
    else:
        for i in range(u.size):
            out[i] = _bf16_bits(u[i], False)


@njit(cache=True, nogil=True)
def bf16_to_f32(h, out, add):
    """bfloat16 bit patterns (uint16) -> float32 (exact); ``add``: ``out +=``."""
    if add:
        for i in range(h.size):
            out[i] += u32_as_f32(_U32(_U32(h[i]) << _U32(16)))
    else:
        for i in range(h.size):
            out[i] = u32_as_f32(_U32(_U32(h[i]) << _U32(16)))


@njit(cache=True, nogil=True, inline="always")
def _compensate_block(xb, eb, has_e, ob):
    """``ob = xb + eb`` (``xb`` without ``has_e``); returns how many are
    non-finite (``v - v`` is NaN exactly for inf and NaN)."""
    bad = 0
    if has_e:
        for k in range(xb.size):
            v = xb[k] + eb[k]
            ob[k] = v
            bad += (v - v) != 0
    else:
        for k in range(xb.size):
            v = xb[k]
            ob[k] = v
            bad += (v - v) != 0
    return bad


@njit(cache=True, nogil=True, inline="always")
def _half_round(w, bf16):
    """fp16 or (saturating) bf16 bits, as uint32, of the float32 bits ``w``."""
    return _bf16_bits(w, True) if bf16 else _f16_bits(w)


@njit(cache=True, nogil=True, inline="always")
def _half_value(h, bf16):
    """The float32 value of fp16 or bf16 bits ``h``."""
    return u32_as_f32(_U32(_U32(h) << _U32(16))) if bf16 else _f16_value(h)


@njit(cache=True, nogil=True, inline="always")
def _half_feedback(x, e, has_e, bf16, bits, e_out):
    """The loop of :func:`half_encode_feedback`; returns whether any ``v``
    is non-finite (an or, not a count: a 64-bit counter would narrow the
    vector lanes to four)."""
    nonfinite = False
    if has_e:
        for i in range(x.size):
            v = x[i] + e[i]
            nonfinite |= (v - v) != 0
            h = _half_round(f32_as_u32(v), bf16)
            bits[i] = h
            e_out[i] = v - _half_value(h, bf16)
    else:
        for i in range(x.size):
            v = x[i]
            nonfinite |= (v - v) != 0
            h = _half_round(f32_as_u32(v), bf16)
            bits[i] = h
            e_out[i] = v - _half_value(h, bf16)
    return nonfinite


@njit(cache=True, nogil=True)
def _count_nonfinite_values(x):
    """How many entries of ``x`` are non-finite."""
    bad = 0
    for i in range(x.size):
        v = x[i]
        bad += (v - v) != 0
    return bad


@njit(cache=True, nogil=True)
def half_encode_feedback(x, e, has_e, bf16, bits, e_out):
    """fp16 / bf16 (saturating) bits of ``v = x + e`` (``v = x`` without
    ``has_e``) into ``bits``, and ``e_out = v - decode(bits)``, in one
    vectorized pass, element by element: ``v`` is rounded (:func:`_f16_bits`
    / :func:`_bf16_bits`), widened back and subtracted -- the bits of the
    three steps.  Returns the number of non-finite ``v`` (``v - v`` is NaN
    exactly for inf and NaN), counted in ``e_out`` when there are any: it is
    non-finite exactly where ``v`` is (a finite ``v`` decodes to a finite
    value of its sign, saturated, and the difference stays finite)."""
    if bf16:
        nonfinite = _half_feedback(x, e, has_e, True, bits, e_out)
    else:
        nonfinite = _half_feedback(x, e, has_e, False, bits, e_out)
    return _count_nonfinite_values(e_out) if nonfinite else 0


@njit(cache=True, nogil=True, inline="always")
def _widen_block(bb, bf16, dec, add):
    """``dec (+)= widen(bb)`` for a block of fp16 / bf16 bit patterns."""
    if bf16:
        bf16_to_f32(bb, dec, add)
    else:
        f16_to_f32(bb, dec, add)


@njit(cache=True, nogil=True)
def half_owner_step(received, bf16, e, has_e, feedback, bits, e_out, out):
    """The owner stage of ``twoshot`` for fp16 / bf16, one block at a time
    (all of it in cache): ``acc = 0 + widen(received[0]) + widen(received[1])
    + ...`` in rank order, ``w = acc + e`` (``acc`` without ``has_e``), its
    bits into ``bits``, ``e_out = w - widen(bits)`` (with ``feedback``) and
    ``out = widen(bits)``, what every rank decodes the packet to.  The bits of
    decode-add, compensate, re-encode, decode and subtract.  Returns the
    number of non-finite ``w``."""
    n = out.size
    acc = np.empty(BLOCK, dtype=np.float32)
    dec = np.empty(BLOCK, dtype=np.float32)
    bad = 0
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        m = bhi - blo
        ab = acc[:m]
        for k in range(m):
            ab[k] = 0.0
        for src in range(received.shape[0]):
            _widen_block(received[src, blo:bhi], bf16, ab, True)
        if feedback:
            wb = e_out[blo:bhi]
            bad += _compensate_block(ab, e[blo:bhi], has_e, wb)
        else:
            wb = ab
            for k in range(m):
                v = ab[k]
                bad += (v - v) != 0
        bb = bits[blo:bhi]
        if bf16:
            f32_to_bf16(wb.view(np.uint32), bb, True)
        else:
            f32_to_f16(wb.view(np.uint32), bb)
        db = dec[:m]
        _widen_block(bb, bf16, db, False)
        ob = out[blo:bhi]
        for k in range(m):
            ob[k] = db[k]
        if feedback:
            for k in range(m):
                wb[k] = wb[k] - db[k]
    return bad


# ---------------------------------------------------------------------------
# onebit
# ---------------------------------------------------------------------------
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
def _pack_signs(x, lo, hi, words, carry):
    """Sign bits of ``x[lo:hi]`` into ``words`` at absolute bit positions;
    ``carry`` is the pending partial word before ``lo``.  Returns the pending
    partial word after ``hi`` (stored by the caller at the very end)."""
    i = np.uint64(lo)
    end = np.uint64(hi)
    while i < end and (i & _U31) != _U0:         # head: up to a word boundary
        carry |= np.int64(x[i] >= 0) << np.int64(i & _U31)
        i += _U1
        if (i & _U31) == _U0:
            words[(i >> _U5) - _U1] = carry
            carry = 0
    while i + _U32 <= end:                       # body: whole words
        w = np.int64(0)
        for k in range(32):
            w |= np.int64(x[i + np.uint64(k)] >= 0) << k
        words[i >> _U5] = w
        i += _U32
    while i < end:                               # tail: a partial word
        carry |= np.int64(x[i] >= 0) << np.int64(i & _U31)
        i += _U1
    return carry


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


# ---------------------------------------------------------------------------
# b-bit two's complement codes (terngrad, qsgd)
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _pack_block(codes, m, bits, packed, first):
    """Pack ``codes[0:m]`` (an int8 scratch of :data:`BLOCK` codes, two's
    complement) into ``packed`` from byte ``first`` on; element 0 starts a
    byte.  Whole bytes are built from uint32 / uint16 views of the scratch
    (little-endian: code ``k`` of a word sits in its byte ``k``)."""
    full = (m * bits) >> 3
    dst = packed[first:first + full]
    if bits == 2:
        quads = codes.view(np.uint32)
        for j in range(full):
            w = quads[j]
            dst[j] = (w & 0x3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0)
    elif bits == 4:
        pairs = codes.view(np.uint16)
        for j in range(full):
            w = pairs[j]
            dst[j] = (w & 0xF) | ((w >> 4) & 0xF0)
    else:
        raw = codes.view(np.uint8)
        for j in range(full):
            dst[j] = raw[j]
    per = 8 // bits
    if full * per < m:
        byte = np.int64(0)
        for k in range(m - full * per):
            byte |= (np.int64(codes[full * per + k]) & ((1 << bits) - 1)) << (k * bits)
        packed[first + full] = byte


_SPLAT2 = np.uint32(0x02020202)
_SPLAT_7E = np.uint32(0x7E7E7E7E)
_SPLAT_80 = np.uint32(0x80808080)


@njit(cache=True, nogil=True, inline="always")
def _unpack_block(packed, first, m, bits, codes):
    """Sign-extend ``m`` packed ``bits``-bit codes (the first one at byte
    ``first`` of ``packed``) into the int8 scratch ``codes`` (a multiple of
    4 long; up to 3 entries past ``m`` are written).  Each packed byte is
    spread into a uint16 / uint32 word of the scratch, one code per byte
    (little-endian), and sign-extended in all bytes at once: with ``y = c ^
    h`` (``h = 2**(bits - 1)``) in every byte, ``(y + 0x80 - h) ^ 0x80`` is
    ``y - h`` modulo 256 and never carries into the next byte."""
    src = packed[first:first + ((m * bits + 7) >> 3)]
    if bits == 2:
        quads = codes.view(np.uint32)
        for j in range(src.size):
            b = np.uint32(src[j])
            w = (b & np.uint32(0x03)) | ((b & np.uint32(0x0C)) << np.uint32(6)) \
                | ((b & np.uint32(0x30)) << np.uint32(12)) \
                | ((b & np.uint32(0xC0)) << np.uint32(18))
            quads[j] = ((w ^ _SPLAT2) + _SPLAT_7E) ^ _SPLAT_80
    elif bits == 4:
        pairs = codes.view(np.uint16)
        for j in range(src.size):
            b = np.uint16(src[j])
            w = (b & np.uint16(0x0F)) | ((b & np.uint16(0xF0)) << np.uint16(4))
            pairs[j] = ((w ^ np.uint16(0x0808)) + np.uint16(0x7878)) ^ np.uint16(0x8080)
    else:
        raw = codes.view(np.uint8)
        for j in range(src.size):
            raw[j] = src[j]


@njit(cache=True, nogil=True, inline="always")
def _scale_codes(codes, unit, out, add):
    if add:
        for k in range(out.size):
            out[k] += np.float32(codes[k] * unit)
    else:
        for k in range(out.size):
            out[k] = np.float32(codes[k] * unit)


@njit(cache=True, nogil=True, inline="always")
def _decode_range(packed, bits, bucket, levels, scales, lo, hi, codes, ob, add):
    """Elements ``lo .. hi - 1`` of a packet's codes (``lo`` starts a byte),
    decoded into ``ob`` (``hi - lo`` long; ``add``: ``ob +=``) through the int8
    scratch ``codes``: one bucket's piece at a time."""
    _unpack_block(packed, (lo * bits) >> 3, hi - lo, bits, codes)
    i = lo
    while i < hi:
        j = i // bucket
        seg = min((j + 1) * bucket, hi)
        _scale_codes(codes[i - lo:seg - lo], np.float64(scales[j]) / levels,
                     ob[i - lo:seg - lo], add)
        i = seg


@njit(cache=True, nogil=True)
def codes_decode(packed, bits, bucket, levels, scales, out, add):
    """Dense values of packed ``bits``-bit codes: element ``i`` of bucket
    ``j = i // bucket`` decodes to ``float32(q_i * (float64(scales[j]) / levels))``;
    ``add``: ``out +=``."""
    n = out.size
    codes = np.empty(BLOCK, dtype=np.int8)
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        _decode_range(packed, bits, bucket, levels, scales, blo, bhi, codes, out[blo:bhi],
                      add)


@njit(cache=True, nogil=True, inline="always")
def _decode_sum_range(rcodes, bits, bucket, levels, rscales, lo, hi, codes, ab):
    """``ab = 0 + decode(packet 0) + decode(packet 1) + ...`` over elements
    ``lo .. hi - 1``, in packet order: the bits of zeroing and adding each
    packet with :func:`codes_decode`.  Row ``src`` of ``rcodes`` / ``rscales``
    holds packet ``src``'s codes / scales."""
    for k in range(ab.size):
        ab[k] = 0.0
    for src in range(rcodes.shape[0]):
        _decode_range(rcodes[src], bits, bucket, levels, rscales[src], lo, hi, codes, ab, True)


@njit(cache=True, nogil=True)
def summed_decode(total, bucket, levels, scales, out, add):
    """Like :func:`codes_decode` for unpacked integer codes (or sums of them)."""
    n = out.size
    for j in range(scales.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        _scale_codes(total[lo:hi], np.float64(scales[j]) / levels, out[lo:hi], add)


@njit(cache=True, nogil=True, inline="always")
def _v(x, e, i):
    """``v = x[i] + e[i]`` in float32, or ``x[i]`` for ``e=None`` (``i``
    uint64: no wraparound checks).  The optional operands of the kernels
    below are None or arrays, never an optional type, so that numba drops
    the unused branch."""
    if e is None:
        return x[i]
    return x[i] + e[i]


@njit(cache=True, nogil=True, inline="always")
def _row_split(m):
    """How the lane sums walk ``m`` elements: ``(full, body)`` -- groups of
    :data:`ROWS` rows of :data:`LANES` up to ``full``, then whole rows up to
    ``body``, then a partial row."""
    return m - m % (ROWS * LANES), m - m % LANES


# ---------------------------------------------------------------------------
# terngrad
# ---------------------------------------------------------------------------
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


@njit(cache=True, nogil=True)
def _count_nonfinite(x, e, lo, hi):
    """How many ``v = x + e`` (``x`` for ``e=None``) over ``[lo, hi)`` are
    non-finite (``v - v`` is NaN exactly for inf and NaN).  Kernels whose
    sums turn non-finite exactly when some ``v`` is call it only then."""
    bad = 0
    for k in range(hi - lo):
        v = _v(x, e, np.uint64(lo + k))
        bad += (v - v) != 0
    return bad


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


@njit(cache=True, nogil=True)
def tern_owner_stats(rcodes, rscales, e, out):
    """Pass 1 of TernGrad's owner step: ``out = 0 + decode(packet 0) +
    decode(packet 1) + ...`` in packet order (row ``src`` of ``rcodes``: a
    packet's 2-bit codes, ``rscales[src, 0]`` its scale) and
    :func:`tern_stats` of ``w = out + e`` (``out`` for ``e=None``), a block
    at a time."""
    n = out.size
    if n == 0:
        return np.float32(0.0), 0.0, 0.0, 0.0, 0.0, 0
    codes = np.empty(BLOCK, dtype=np.int8)
    mx = np.zeros(LANES, dtype=np.float32)
    acc = np.zeros(3 * LANES)
    x0 = 0.0
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        _decode_sum_range(rcodes, 2, n, 1, rscales, blo, bhi, codes, out[blo:bhi])
        if blo == 0:
            x0 = np.float64(_v(out, e, _U0))
        _tern_moments(out, e, blo, bhi, x0, mx, acc)
    top, s1, s2, l1, l2 = _tern_totals(n, x0, mx, acc)
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


# ---------------------------------------------------------------------------
# qsgd
# ---------------------------------------------------------------------------
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
    return _qsgd_encode(out, e, e_out, out, rcodes, rscales, rbits, rbucket, rlevels,
                        bucket, bits, levels, use_max, key, offset, scales, packed, contract,
                        omega, omega_last)


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


# ---------------------------------------------------------------------------
# fp8: block-scaled e4m3 / e5m2
# ---------------------------------------------------------------------------
#: the two FP8 formats, by their header code: (largest finite value, its code)
FP8_E4M3, FP8_E5M2 = 0, 1
FP8_MAX = (448.0, 57344.0)


@njit(cache=True, nogil=True, inline="always")
def _fp8_bits(w, e5m2):
    """The FP8 bit pattern (as uint32) of the float32 with bit pattern ``w``,
    rounded to nearest even: OCP e4m3 (``e4m3fn``: bias 7, no infinity, NaN
    ``S.1111.111``) or e5m2 (bias 15, IEEE-like).  Finite values that would
    round beyond the largest finite (448 / 57344) **saturate** to it; +-inf
    becomes +-inf in e5m2 and NaN (``0x7F`` with the sign) in e4m3, which
    has no infinity; NaN becomes the quiet NaN ``0x7F`` / ``0x7E`` with its
    sign.  Branch-free, 32-bit lanes, as :func:`_f16_bits`: subnormals from
    one float addition (``c + |v|``, ``c`` = 2**14 / 2**7, whose float32
    spacing is the FP8 subnormal step 2**-9 / 2**-16), normals by re-biasing
    the exponent and rounding away the low 20 / 21 bits."""
    a = _U32(w & _U32(0x7FFFFFFF))
    if e5m2:
        sub = _U32(f32_as_u32(u32_as_f32(a) + np.float32(128.0)) - _U32(0x43000000))
        norm = _U32(_U32(_U32(a - _U32(0x37F00001)) + _U32(_U32(a >> _U32(21)) & _U32(1)))
                    >> _U32(21))
        h = sub if a < _U32(0x38800000) else norm        # below 2**-14: subnormal
        h = _U32(0x7B) if h > _U32(0x7B) else h           # saturate at 57344
        special = _U32(0x7E) if a > _U32(0x7F800000) else _U32(0x7C)
    else:
        sub = _U32(f32_as_u32(u32_as_f32(a) + np.float32(16384.0)) - _U32(0x46800000))
        norm = _U32(_U32(_U32(a - _U32(0x3BF80001)) + _U32(_U32(a >> _U32(20)) & _U32(1)))
                    >> _U32(20))
        h = sub if a < _U32(0x3C800000) else norm        # below 2**-6: subnormal
        h = _U32(0x7E) if h > _U32(0x7E) else h           # saturate at 448
        special = _U32(0x7F)
    h = special if a >= _U32(0x7F800000) else h
    return _U32(h | _U32(_U32(w >> _U32(24)) & _U32(0x80)))


@njit(cache=True, nogil=True, inline="always")
def _fp8_value(q, e5m2):
    """The float32 value of the FP8 bit pattern ``q`` (exact): normals by
    re-biasing the exponent, subnormals as ``m * 2**-9`` / ``m * 2**-16``,
    NaN as the canonical quiet NaN with ``q``'s sign, e5m2's +-inf."""
    b = _U32(q)
    m = _U32(b & _U32(0x7F))
    if e5m2:
        r = _U32(_U32(m << _U32(21)) + _U32(0x38000000))
        r = f32_as_u32(np.float32(m) * np.float32(2.0 ** -16)) if m < _U32(0x4) else r
        r = (_U32(0x7F800000) if m == _U32(0x7C) else _U32(0x7FC00000)) \
            if m >= _U32(0x7C) else r
    else:
        r = _U32(_U32(m << _U32(20)) + _U32(0x3C000000))
        r = f32_as_u32(np.float32(m) * np.float32(2.0 ** -9)) if m < _U32(0x8) else r
        r = _U32(0x7FC00000) if m == _U32(0x7F) else r
    return u32_as_f32(_U32(r | _U32(_U32(b & _U32(0x80)) << _U32(24))))


@njit(cache=True, nogil=True, inline="always")
def _fp8_decoded(q, e5m2, s):
    """``value(q) * s`` in float32; NaN / inf codes decode to their own
    value, not multiplied (a zero scale would make inf * 0 a NaN)."""
    v = _fp8_value(q, e5m2)
    m = _U32(_U32(q) & _U32(0x7F))
    special = m >= (_U32(0x7C) if e5m2 else _U32(0x7F))
    return v if special else v * s


@njit(cache=True, nogil=True, inline="always")
def _fp8_block(vb, e5m2, fmax, codes):
    """Scale and codes of one block ``vb``: ``s = amax / fmax`` (float32
    division; ``amax`` over the finite entries), ``codes = round(v / d)``
    with ``d = s`` (1 where ``s == 0``).  Returns ``s``."""
    amax = _U32(0)
    for k in range(vb.size):
        a = _U32(f32_as_u32(vb[k]) & _U32(0x7FFFFFFF))
        a = _U32(0) if a >= _U32(0x7F800000) else a
        amax = a if a > amax else amax
    s = u32_as_f32(amax) / np.float32(fmax)
    d = s if s > np.float32(0.0) else np.float32(1.0)
    for k in range(vb.size):
        codes[k] = _fp8_bits(f32_as_u32(vb[k] / d), e5m2)
    return s


@njit(cache=True, nogil=True)
def fp8_scaled_bits(y, e5m2, out):
    """FP8 bits (uint8) of the float32 values ``y``, no scaling (the
    rounding alone, for tests)."""
    for i in range(y.size):
        out[i] = _fp8_bits(f32_as_u32(y[i]), e5m2)


@njit(cache=True, nogil=True)
def fp8_encode(x, e5m2, block, scales, codes):
    """Block-scaled FP8 of ``x``: per block of ``block`` elements (the last
    one shorter) its float32 scale into ``scales`` and codes into ``codes``
    (:func:`_fp8_block`)."""
    n = x.size
    fmax = 57344.0 if e5m2 else 448.0
    for c, blo in enumerate(range(0, n, block)):
        bhi = min(blo + block, n)
        if e5m2:
            scales[c] = _fp8_block(x[blo:bhi], True, fmax, codes[blo:bhi])
        else:
            scales[c] = _fp8_block(x[blo:bhi], False, fmax, codes[blo:bhi])


@njit(cache=True, nogil=True)
def fp8_decode(codes, scales, e5m2, block, out, add):
    """``out (+)= codes * scale of their block`` in float32
    (:func:`_fp8_decoded`)."""
    n = out.size
    for c, blo in enumerate(range(0, n, block)):
        bhi = min(blo + block, n)
        s = scales[c]
        if add:
            for i in range(blo, bhi):
                out[i] += _fp8_decoded(codes[i], e5m2, s)
        else:
            for i in range(blo, bhi):
                out[i] = _fp8_decoded(codes[i], e5m2, s)


@njit(cache=True, nogil=True)
def fp8_encode_feedback(x, e, has_e, e5m2, block, scales, codes, e_out):
    """The packet fields of ``v = x + e`` (``v = x`` without ``has_e``) and
    ``e_out = v - decode``, block by block (``v`` is staged in ``e_out``
    while its block is in cache): the bits of encode, decode and subtract.
    Returns the number of non-finite ``v``."""
    n = x.size
    fmax = 57344.0 if e5m2 else 448.0
    bad = 0
    for c, blo in enumerate(range(0, n, block)):
        bhi = min(blo + block, n)
        vb = e_out[blo:bhi]
        bad += _compensate_block(x[blo:bhi], e[blo:bhi], has_e, vb)
        cb = codes[blo:bhi]
        s = _fp8_block(vb, e5m2, fmax, cb)
        scales[c] = s
        for k in range(bhi - blo):
            vb[k] = vb[k] - _fp8_decoded(cb[k], e5m2, s)
    return bad


@njit(cache=True, nogil=True)
def fp8_owner_step(rscales, rcodes, rblock, e5m2, e, has_e, feedback, block, scales, codes,
                   e_out, out):
    """The owner stage of ``twoshot`` for fp8: ``acc = 0 + decode(received[0])
    + decode(received[1]) + ...`` in rank order (blocks of ``rblock``),
    ``w = acc + e`` (``acc`` without ``has_e``), its scales and codes (blocks
    of ``block``), ``e_out = w - decode`` (with ``feedback``) and ``out =
    decode``.  The bits of decode-add, compensate, re-encode, decode and
    subtract.  Returns the number of non-finite ``w``."""
    n = out.size
    for i in range(n):
        out[i] = 0.0
    for src in range(rcodes.shape[0]):
        fp8_decode(rcodes[src], rscales[src], e5m2, rblock, out, True)
    fmax = 57344.0 if e5m2 else 448.0
    bad = 0
    for c, blo in enumerate(range(0, n, block)):
        bhi = min(blo + block, n)
        ab = out[blo:bhi]
        if feedback:
            wb = e_out[blo:bhi]
            bad += _compensate_block(ab, e[blo:bhi], has_e, wb)
        else:
            wb = ab
            for k in range(bhi - blo):
                v = ab[k]
                bad += (v - v) != 0
        cb = codes[blo:bhi]
        s = _fp8_block(wb, e5m2, fmax, cb)
        scales[c] = s
        for k in range(bhi - blo):
            d = _fp8_decoded(cb[k], e5m2, s)
            if feedback:
                wb[k] = wb[k] - d
            ab[k] = d
    return bad
