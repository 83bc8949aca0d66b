"""CPU kernels of the ``fp16`` and ``bf16`` codecs (and of
:mod:`hpccomm.buffers.dtypes`' bfloat16 rounding).

The conversions are branch-free selects on uint32 bit patterns (floats
reinterpreted with :mod:`hpccomm.kernels.bitcast`), every intermediate cast
back to uint32 so that the lanes stay 32 bits wide; numba has no float16
conversion in nopython mode.  What the quantizing kernels share is in
:mod:`.quant_common`; :mod:`hpccomm.kernels.cuda_quantize` produces the same
bytes on a GPU.
"""
import numpy as np
from numba import njit

from .bitcast import f32_as_u32, u32_as_f32
from .quant_common import BLOCK, _compensate_block, strided_rows

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


# one compiled function per format, each compiled on its first call: an fp16
# run compiles no bf16 loop (the two in one function took 3.7 s of one core)
@njit(cache=True, nogil=True)
def _f16_encode_feedback(x, e, has_e, bits, e_out):
    nonfinite = _half_feedback(x, e, has_e, False, bits, e_out)
    return _count_nonfinite_values(e_out) if nonfinite else 0


@njit(cache=True, nogil=True)
def _bf16_encode_feedback(x, e, has_e, bits, e_out):
    nonfinite = _half_feedback(x, e, has_e, True, bits, e_out)
    return _count_nonfinite_values(e_out) if nonfinite else 0


def half_encode_feedback(x, e, has_e, bf16, bits, e_out):
    """fp16 / bf16 (saturating) bits of ``v = x + e`` (``v = x`` without
    ``has_e``) into ``bits``, and ``e_out = v - decode(bits)``, in one
    vectorized pass, element by element: ``v`` is rounded (:func:`_f16_bits`
    / :func:`_bf16_bits`), widened back and subtracted -- the bits of the
    three steps.  Returns the number of non-finite ``v`` (``v - v`` is NaN
    exactly for inf and NaN), counted in ``e_out`` when there are any: it is
    non-finite exactly where ``v`` is (a finite ``v`` decodes to a finite
    value of its sign, saturated, and the difference stays finite).  (A
    Python function: it picks the compiled loop of its format.)"""
    if bf16:
        return _bf16_encode_feedback(x, e, has_e, bits, e_out)
    return _f16_encode_feedback(x, e, has_e, bits, e_out)


@njit(cache=True, nogil=True, inline="always")
def _widen_block(bb, bf16, dec, add):
    """``dec (+)= widen(bb)`` for a block of fp16 / bf16 bit patterns."""
    if bf16:
        bf16_to_f32(bb, dec, add)
    else:
        f16_to_f32(bb, dec, add)


def half_owner_step(received, bf16, e, has_e, feedback, bits, e_out, out):
    """The owner stage of ``twoshot`` for fp16 / bf16, one block at a time
    (all of it in cache): ``acc = 0 + widen(received[0]) + widen(received[1])
    + ...`` in rank order, ``w = acc + e`` (``acc`` without ``has_e``), its
    bits into ``bits``, ``e_out = w - widen(bits)`` (with ``feedback``) and
    ``out = widen(bits)``, what every rank decodes the packet to.  The bits of
    decode-add, compensate, re-encode, decode and subtract.  Returns the
    number of non-finite ``w``.  (A Python function: it picks the compiled
    step of its format.)"""
    step = _bf16_owner_rows if bf16 else _f16_owner_rows
    return step(received, e, has_e, feedback, bits, e_out, out)


# per format, a body on strided rows and a wrapper that hands it any rows as
# strided (one body for both layouts): a process compiles only its format's pair
@njit(cache=True, nogil=True)
def _f16_owner_rows(received, e, has_e, feedback, bits, e_out, out):
    return _f16_owner_step(strided_rows(received), e, has_e, feedback, bits, e_out, out)


@njit(cache=True, nogil=True)
def _bf16_owner_rows(received, e, has_e, feedback, bits, e_out, out):
    return _bf16_owner_step(strided_rows(received), e, has_e, feedback, bits, e_out, out)


@njit(cache=True, nogil=True)
def _f16_owner_step(received, e, has_e, feedback, bits, e_out, out):
    return _owner_blocks(received, False, e, has_e, feedback, bits, e_out, out)


@njit(cache=True, nogil=True)
def _bf16_owner_step(received, e, has_e, feedback, bits, e_out, out):
    return _owner_blocks(received, True, e, has_e, feedback, bits, e_out, out)


@njit(cache=True, nogil=True, inline="always")
def _owner_blocks(received, bf16, e, has_e, feedback, bits, e_out, out):
    """:func:`half_owner_step`'s loop, ``bf16`` a constant of its caller."""
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
