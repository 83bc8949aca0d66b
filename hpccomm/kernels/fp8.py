"""CPU kernels of the ``fp8`` codec: block-scaled e4m3 / e5m2.

The conversions are branch-free selects on uint32 bit patterns, as those of
:mod:`.halfwidth`.  The format is in :mod:`hpccomm.codecs.fp8`.
"""
import numpy as np
from numba import njit

from .bitcast import f32_as_u32, u32_as_f32
from .quant_common import _compensate_block, strided_rows

_U32 = np.uint32
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
    return _fp8_owner_step(strided_rows(rscales), strided_rows(rcodes), rblock, e5m2, e, has_e,
                           feedback, block, scales, codes, e_out, out)


@njit(cache=True, nogil=True)
def _fp8_owner_step(rscales, rcodes, rblock, e5m2, e, has_e, feedback, block, scales, codes,
                    e_out, out):
    """:func:`fp8_owner_step` on strided rows (one body for both layouts)."""
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
