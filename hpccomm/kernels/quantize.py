"""CPU kernels of the quantizing codecs: fp16, bf16, onebit, terngrad, qsgd.

numba ``@njit(cache=True)`` loops over flat, contiguous arrays.  The codecs in
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

Performance notes: the kernels are single-threaded (no ``prange``); encoders
read the input once where the format allows (TernGrad needs its scale first:
two passes), working block by block through small L1-resident scratch
arrays.  Hot loops index slices with ``range`` variables, or with uint64, so
that numba emits no negative-index wraparound (which defeats vectorization).
Packing through uint16 / uint32 views of the scratch assumes a little-endian
host.  The fp16 / bf16 conversions are branch-free selects on uint32 bit
patterns (floats reinterpreted with :mod:`hpccomm.kernels.bitcast`), every
intermediate cast back to uint32 so that the lanes stay 32 bits wide; numba
has no float16 conversion in nopython mode.
"""
import math

import numpy as np
from numba import njit, prange

from .bitcast import f32_as_u32, u32_as_f32
from .rng import uniform01_cpu

#: float64 partial sums per reduction (see the module docstring)
LANES = 32
#: elements per block of the blocked encoders (a multiple of 32)
BLOCK = 4096
F32_MAX = float(np.finfo(np.float32).max)

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U5 = np.uint64(5)
_U31 = np.uint64(31)
_U32 = np.uint64(32)


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True)
def f32_to_f16(u, out):
    """float32 bit patterns ``u`` (uint32) -> IEEE half bit patterns
    (uint16), rounding to nearest even.  Finite values beyond the half range
    saturate to +-65504; +-inf stay infinite; NaN becomes a quiet NaN of the
    same sign (:func:`_f16_bits`)."""
    for i in range(u.size):
        out[i] = _f16_bits(u[i])


@njit(cache=True)
def f16_to_f32(h, out, add):
    """IEEE half bit patterns (uint16) -> float32 (exact, NaN canonical:
    :func:`_f16_value`); ``add``: ``out +=``."""
    if add:
        for i in range(h.size):
            out[i] += _f16_value(h[i])
    else:
        for i in range(h.size):
            out[i] = _f16_value(h[i])


@njit(cache=True, inline="always")
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


@njit(cache=True)
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


@njit(cache=True)
def bf16_to_f32(h, out, add):
    """bfloat16 bit patterns (uint16) -> float32 (exact); ``add``: ``out +=``."""
    if add:
        for i in range(h.size):
            out[i] += u32_as_f32(_U32(_U32(h[i]) << _U32(16)))
    else:
        for i in range(h.size):
            out[i] = u32_as_f32(_U32(_U32(h[i]) << _U32(16)))


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _half_round(w, bf16):
    """fp16 or (saturating) bf16 bits, as uint32, of the float32 bits ``w``."""
    return _bf16_bits(w, True) if bf16 else _f16_bits(w)


@njit(cache=True, inline="always")
def _half_value(h, bf16):
    """The float32 value of fp16 or bf16 bits ``h``."""
    return u32_as_f32(_U32(_U32(h) << _U32(16))) if bf16 else _f16_value(h)


@njit(cache=True, inline="always")
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


@njit(cache=True)
def _count_nonfinite(x):
    bad = 0
    for i in range(x.size):
        v = x[i]
        bad += (v - v) != 0
    return bad


@njit(cache=True)
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
    return _count_nonfinite(e_out) if nonfinite else 0


@njit(cache=True, inline="always")
def _widen_block(bb, bf16, dec, add):
    """``dec (+)= widen(bb)`` for a block of fp16 / bf16 bit patterns."""
    if bf16:
        bf16_to_f32(bb, dec, add)
    else:
        f16_to_f32(bb, dec, add)


@njit(cache=True)
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
@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
def onebit_encode_feedback(x, e, has_e, col_len, means, words, e_out):
    """:func:`onebit_encode` of ``v = x + e`` (``v = x`` without ``has_e``)
    and the new residual ``e_out = v - decode(packet)``, in one pass over
    ``x`` and ``e`` (``v`` lives in ``e_out`` until its column's means are
    known) -- the same bits as encoding, decoding and subtracting.  Returns
    the number of non-finite ``v`` (``e_out`` is then meaningless)."""
    return _onebit_encode(x, e, has_e, True, col_len, means, words, e_out)


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True, inline="always")
def _tile(t, tile_cols, ncols, col_len, n, nwords):
    """Columns ``[c0, c1)``, elements ``[lo, hi)`` and words ``[w0, w1)`` of
    tile ``t`` (the last tile takes the words to the end)."""
    c0 = t * tile_cols
    c1 = min(c0 + tile_cols, ncols)
    lo = c0 * col_len
    hi = min(c1 * col_len, n)
    w1 = nwords if c1 == ncols else hi // 32
    return c0, c1, lo, hi, lo // 32, w1


@njit(cache=True, parallel=True)
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


@njit(cache=True, parallel=True)
def onebit_decode_tiles(words, means, col_len, out, add, tile_cols):
    """:func:`onebit_decode` tile by tile on several threads."""
    n = out.size
    ncols = means.size // 2
    for t in prange((ncols + tile_cols - 1) // tile_cols):
        c0, c1, lo, hi, w0, w1 = _tile(t, tile_cols, ncols, col_len, n, words.size)
        onebit_decode(words[w0:w1], means[2 * c0:2 * c1], col_len, out[lo:hi], add)


@njit(cache=True, parallel=True)
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
@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _unpack_codes(src, m, bits, codes):
    """Sign-extend ``m`` packed ``bits``-bit codes (``src`` starts at the
    first one's byte) into the int8 scratch ``codes``."""
    per = 8 // bits
    mask = (1 << bits) - 1
    half = 1 << (bits - 1)
    full = m // per
    for j in range(full):
        b = np.int64(src[j])
        for k in range(per):
            codes[j * per + k] = (((b >> (k * bits)) & mask) ^ half) - half
    if full * per < m:
        b = np.int64(src[full])
        for k in range(m - full * per):
            codes[full * per + k] = (((b >> (k * bits)) & mask) ^ half) - half


@njit(cache=True, inline="always")
def _unpack_block(packed, first, m, bits, codes):
    # literal bit widths let the compiler unroll and vectorize each case
    src = packed[first:first + ((m * bits + 7) >> 3)]
    if bits == 2:
        _unpack_codes(src, m, 2, codes)
    elif bits == 4:
        _unpack_codes(src, m, 4, codes)
    else:
        _unpack_codes(src, m, 8, codes)


@njit(cache=True)
def codes_decode(packed, bits, bucket, levels, scales, out, add):
    """Dense values of packed ``bits``-bit codes: element ``i`` of bucket
    ``j = i // bucket`` decodes to ``float32(q_i * (float64(scales[j]) / levels))``;
    ``add``: ``out +=``."""
    n = out.size
    codes = np.empty(BLOCK, dtype=np.int8)
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        _unpack_block(packed, (blo * bits) >> 3, bhi - blo, bits, codes)
        i = blo
        while i < bhi:
            j = i // bucket
            seg = min((j + 1) * bucket, bhi)
            _scale_codes(codes[i - blo:seg - blo], np.float64(scales[j]) / levels,
                         out[i:seg], add)
            i = seg


@njit(cache=True, inline="always")
def _scale_codes(codes, unit, out, add):
    if add:
        for k in range(out.size):
            out[k] += np.float32(codes[k] * unit)
    else:
        for k in range(out.size):
            out[k] = np.float32(codes[k] * unit)


@njit(cache=True)
def summed_decode(total, bucket, levels, scales, out, add):
    """Like :func:`codes_decode` for unpacked integer codes (or sums of them)."""
    n = out.size
    for j in range(scales.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        _scale_codes(total[lo:hi], np.float64(scales[j]) / levels, out[lo:hi], add)


# ---------------------------------------------------------------------------
# terngrad
# ---------------------------------------------------------------------------
@njit(cache=True)
def tern_stats(x):
    """``(max|x|, S1, S2)``: ``S1 = sum(x - x[0])`` and ``S2 = sum((x - x[0])**2)``
    in float64 lanes (shifted sums: exactly zero variance for constant input).
    A NaN anywhere makes ``S1`` NaN; ``max|x|`` ignores NaN."""
    n = x.size
    if n == 0:
        return np.float32(0.0), 0.0, 0.0
    x0 = np.float64(x[0])
    mx = np.zeros(LANES, dtype=np.float32)
    acc = np.zeros(2 * LANES)
    body = n - n % LANES
    for w in range(body // LANES):
        i0 = w * LANES
        for k in range(LANES):
            v = x[i0 + k]
            a = abs(v)
            mx[k] = a if a > mx[k] else mx[k]
            d = np.float64(v) - x0
            acc[k] += d
            acc[LANES + k] += d * d
    for k in range(n - body):
        v = x[body + k]
        a = abs(v)
        mx[k] = a if a > mx[k] else mx[k]
        d = np.float64(v) - x0
        acc[k] += d
        acc[LANES + k] += d * d
    return mx.max(), _lane_total(acc, 0), _lane_total(acc, LANES)


@njit(cache=True, inline="always")
def _tern_code(v, u, scale, clip):
    sign = np.int64(v > 0) - np.int64(v < 0)
    return sign if u * scale < min(abs(v), clip) else 0


@njit(cache=True)
def tern_codes(x, key, offset, scale, clip, codes):
    """Stochastic ternary codes, one per element of ``codes`` (any integer
    dtype): ``sign(x_i)`` if ``u_i * scale < min(|x_i|, clip)`` else 0, in
    float32 arithmetic."""
    base = np.uint64(offset)
    for i in range(x.size):
        u = uniform01_cpu(key, base + np.uint64(i))
        codes[i] = _tern_code(x[i], u, scale, clip)


@njit(cache=True)
def tern_pack(x, key, offset, scale, clip, packed):
    """The codes of :func:`tern_codes`, 2-bit packed into ``packed``
    (``ceil(n / 4)`` bytes)."""
    n = x.size
    codes = np.empty(BLOCK, dtype=np.int8)
    for lo in range(0, n, BLOCK):
        m = min(BLOCK, n - lo)
        tern_codes(x[lo:lo + m], key, offset + lo, scale, clip, codes)
        _pack_block(codes, m, 2, packed, lo >> 2)


# ---------------------------------------------------------------------------
# qsgd
# ---------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _bucket_scale(xb, use_max, acc):
    """float32 scale of one bucket: max |x| (NaN if any NaN), or the l2 norm
    from float64 lane sums of squares, rounded once (finite norms beyond the
    float32 range saturate to its maximum).  ``acc``: 2 LANES float64 scratch."""
    m = xb.size
    body = m - m % LANES
    if use_max:
        mx = acc[:LANES]
        mx[:] = 0.0
        nan = 0
        for w in range(body // LANES):
            i0 = w * LANES
            for k in range(LANES):
                a = np.float64(abs(xb[i0 + k]))
                mx[k] = a if a > mx[k] else mx[k]
                nan |= np.int64(a != a)
        for k in range(m - body):
            a = np.float64(abs(xb[body + k]))
            mx[k] = a if a > mx[k] else mx[k]
            nan |= np.int64(a != a)
        return np.float32(np.nan) if nan else np.float32(mx.max())
    acc[:LANES] = 0.0
    for w in range(body // LANES):
        i0 = w * LANES
        for k in range(LANES):
            v = np.float64(xb[i0 + k])
            acc[k] += v * v
    for k in range(m - body):
        v = np.float64(xb[body + k])
        acc[k] += v * v
    r = np.sqrt(_lane_total(acc, 0))
    if r > F32_MAX and r < np.inf:
        r = F32_MAX
    return np.float32(r)


@njit(cache=True)
def bucket_scales(x, bucket, use_max, scales):
    """Per-bucket scales of ``x`` (see :func:`_bucket_scale`)."""
    n = x.size
    acc = np.zeros(2 * LANES)
    for j in range(scales.size):
        lo = j * bucket
        scales[j] = _bucket_scale(x[lo:min(lo + bucket, n)], use_max, acc)


@njit(cache=True, inline="always")
def _ratio(scale, levels):
    """``levels / scale`` in float64, or 0 when the bucket gets zero codes."""
    if scale > 0 and scale < np.inf:
        return levels / np.float64(scale)
    return 0.0


@njit(cache=True)
def qsgd_codes(x, key, offset, ratio, levels, codes):
    """QSGD codes of ``x`` (one bucket, ``ratio = levels / scale``), one per
    element of ``codes`` (any integer dtype)."""
    base = np.uint64(offset)
    for i in range(x.size):
        u = uniform01_cpu(key, base + np.uint64(i))
        v = x[i]
        q = min(np.int64(abs(np.float64(v)) * ratio + u), levels)
        codes[i] = -q if v < 0 else q


@njit(cache=True)
def qsgd_encode(x, bucket, bits, levels, use_max, key, offset, scales, packed):
    """QSGD reading ``x`` once: per bucket its scale into ``scales[j]`` (see
    :func:`_bucket_scale`), then its stochastically rounded codes, ``bits``-bit
    packed into ``packed`` (``ceil(n bits / 8)`` bytes)."""
    n = x.size
    acc = np.zeros(2 * LANES)
    codes = np.empty(BLOCK, dtype=np.int8)
    j = 0                       # current bucket
    bucket_end = 0
    ratio = 0.0
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        i = blo
        while i < bhi:
            if i == bucket_end:
                lo = j * bucket
                bucket_end = min(lo + bucket, n)
                scale = _bucket_scale(x[lo:bucket_end], use_max, acc)
                scales[j] = scale
                ratio = _ratio(scale, levels)
                j += 1
            seg = min(bucket_end, bhi)
            qsgd_codes(x[i:seg], key, offset + i, ratio, levels, codes[i - blo:seg - blo])
            i = seg
        _pack_block(codes, bhi - blo, bits, packed, (blo * bits) >> 3)


@njit(cache=True)
def qsgd_shared_codes(x, bucket, levels, scales, key, offset, codes):
    """QSGD codes against given per-bucket ``scales`` (e.g. MAX-shared across
    ranks), one per element of ``codes``."""
    n = x.size
    for j in range(scales.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        qsgd_codes(x[lo:hi], key, offset + lo, _ratio(scales[j], levels), levels,
                   codes[lo:hi])
