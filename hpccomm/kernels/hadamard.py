"""CPU kernels of the randomized Hadamard rotation (``rotate=True`` of the
dense quantizers, :mod:`hpccomm.codecs.rotation`).

A vector of ``n`` elements is cut into *pieces*, counted from its start:
``n // B`` blocks of ``B = 2**k`` elements, then the trailing ``r = n mod B``
elements split into the powers of two of ``r``'s binary form, largest first
(``r = 7``: pieces of 4, 2, 1).  A piece of ``s = 2**j`` elements at ``lo``
is rotated on its own::

    y[lo:lo+s] = c_j * H_s (d[:s] * v[lo:lo+s])       rotate
    v[lo:lo+s] = d[:s] * (c_j * H_s y[lo:lo+s])       unrotate

``H_s`` the unnormalized Sylvester-Hadamard matrix (entries +-1, symmetric,
``H_s H_s = s I``), applied by the in-place fast Walsh-Hadamard transform
(:func:`_fwht`: ``j`` stages of butterflies ``(a, b) -> (a + b, a - b)`` in
float32, a fixed order), ``c_j = float32(2**(-j / 2))`` (exact for even
``j``) and ``d`` a +-1 pattern of length ``B`` (:func:`signs`) whose first
``s`` entries serve a shorter piece.  ``c_j H_s`` is orthogonal and its own
inverse, so unrotate undoes rotate up to float32 rounding: sizes are kept,
nothing is padded.  Every piece is transformed in a scratch of ``B``
elements (4 KiB for ``B = 1024``): each kernel is one pass over its arrays.

Speed without other bits: a piece of 16 or more runs the stages of
:func:`_fwht` in the same order with the same float32 operations, only
grouped -- ``d * v`` into the scratch in a loop LLVM vectorizes, stages 1, 2,
4 in registers per group of 8 (scalar: numba runs no SLP vectorizer), the
middle stages two per sweep over row views whose contiguous lanes LLVM
vectorizes (:func:`_middle`), and the last stage fused with the
normalisation, the signs (unrotate) and the store.  Multiplying by
``d_i = +-1`` is exact, so where it happens does not matter; the order of
the additions does, and ``tests/test_codec_rotation.py`` pins the bits
against a numpy stage-by-stage reference.  Shorter pieces take
:func:`_fwht` itself.

The kernels are single-threaded loops over pieces; pieces are independent,
so the bits depend on the data, ``B`` and ``d`` alone.
"""
import numpy as np
from numba import njit

from .rng import hash_index_cpu

U64_63 = np.uint64(63)
F32_MAX = np.float32(np.finfo(np.float32).max)
#: pieces shorter than this take the plain stage-by-stage path
_FAST = 16


def piece_sizes(n: int, block: int):
    """The piece lengths of a vector of ``n`` elements (plain Python, for
    tests and references): ``n // block`` times ``block``, then the powers
    of two of ``n mod block``, largest first."""
    sizes = [block] * (n // block)
    r = n % block
    bit = block
    while r:
        bit >>= 1
        if r & bit:
            sizes.append(bit)
            r -= bit
    return sizes


@njit(cache=True, nogil=True)
def signs(key, block):
    """The +-1 pattern ``d`` (float32) of length ``block``: ``d_i = -1``
    iff the top bit of :func:`~hpccomm.kernels.rng.hash_index` ``(key, i)``
    is set."""
    out = np.empty(block, dtype=np.float32)
    for i in range(block):
        out[i] = np.float32(-1.0) if (hash_index_cpu(key, np.uint64(i)) >> U64_63) \
            else np.float32(1.0)
    return out


@njit(cache=True, nogil=True, inline="always")
def _fwht(buf, s):
    """The unnormalized Walsh-Hadamard transform of ``buf[:s]`` in place
    (``s`` a power of two): the reference order of the stages, used as is
    for pieces shorter than 16."""
    h = 1
    while h < s:
        for i in range(0, s, 2 * h):
            for j in range(i, i + h):
                a = buf[j]
                b = buf[j + h]
                buf[j] = a + b
                buf[j + h] = a - b
        h *= 2


@njit(cache=True, nogil=True, inline="always")
def _nf(v):
    """1 for a NaN or an infinity, else 0."""
    return 0 if abs(v) <= F32_MAX else 1


@njit(cache=True, nogil=True, inline="always")
def _r8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Stages h = 1, 2, 4 of :func:`_fwht` on 8 consecutive values."""
    b0 = a0 + a1
    b1 = a0 - a1
    b2 = a2 + a3
    b3 = a2 - a3
    b4 = a4 + a5
    b5 = a4 - a5
    b6 = a6 + a7
    b7 = a6 - a7
    c0 = b0 + b2
    c2 = b0 - b2
    c1 = b1 + b3
    c3 = b1 - b3
    c4 = b4 + b6
    c6 = b4 - b6
    c5 = b5 + b7
    c7 = b5 - b7
    return c0 + c4, c1 + c5, c2 + c6, c3 + c7, c0 - c4, c1 - c5, c2 - c6, c3 - c7


@njit(cache=True, nogil=True, inline="always")
def _put8(b8, g, r):
    b8[g, 0] = r[0]
    b8[g, 1] = r[1]
    b8[g, 2] = r[2]
    b8[g, 3] = r[3]
    b8[g, 4] = r[4]
    b8[g, 5] = r[5]
    b8[g, 6] = r[6]
    b8[g, 7] = r[7]


@njit(cache=True, nogil=True, inline="always")
def _radix4(r0, r1, r2, r3, h):
    """Stages ``h`` and ``2h`` on four rows ``h`` apart, lane by lane."""
    for j in range(h):
        a0 = r0[j]
        a1 = r1[j]
        a2 = r2[j]
        a3 = r3[j]
        b0 = a0 + a1
        b1 = a0 - a1
        b2 = a2 + a3
        b3 = a2 - a3
        r0[j] = b0 + b2
        r1[j] = b1 + b3
        r2[j] = b0 - b2
        r3[j] = b1 - b3


@njit(cache=True, nogil=True, inline="always")
def _middle(buf, s):
    """Stages h = 8, 16, ..., s/4 of :func:`_fwht` on ``buf[:s]`` (``s >= 16``)
    in place, two per sweep (the butterflies of stage ``h`` and then ``2h``
    on four values ``h`` apart: the same operations), and the last alone
    when their count is odd.  Stage ``s/2`` is left to the caller.  The
    rows are separate views, indexed from 0: loops LLVM vectorizes."""
    h = 8
    while 8 * h <= s:
        for i in range(0, s, 4 * h):
            _radix4(buf[i:i + h], buf[i + h:i + 2 * h], buf[i + 2 * h:i + 3 * h],
                    buf[i + 3 * h:i + 4 * h], h)
        h *= 4
    if 4 * h <= s:
        for i in range(0, s, 2 * h):
            r0 = buf[i:i + h]
            r1 = buf[i + h:i + 2 * h]
            for j in range(h):
                a = r0[j]
                b = r1[j]
                r0[j] = a + b
                r1[j] = a - b


@njit(cache=True, nogil=True, inline="always")
def _norm(s):
    """``c_j = float32(2**(-j / 2))`` for a piece of ``s = 2**j``."""
    return np.float32(1.0 / np.sqrt(np.float64(s)))


@njit(cache=True, nogil=True, inline="always")
def _piece(lo, n, block):
    """The length of the piece that starts at ``lo`` (see the module docstring)."""
    r = n - lo
    if r >= block:
        return block
    s = block
    while s > r:
        s >>= 1
    return s


@njit(cache=True, nogil=True, inline="always")
def _load_rotate(x, e, has_e, d, lo, s, buf):
    """``buf[:s] = d[:s] * (x + e)[lo:lo+s]`` (a loop LLVM vectorizes), then
    stages 1, 2, 4 in place in groups of 8 (``s >= 8``); returns the count
    of non-finite ``x + e``."""
    xs = x[lo:lo + s]
    ds = d[:s]
    bs = buf[:s]
    nb = 0
    if has_e:
        es = e[lo:lo + s]
        for i in range(s):
            v = xs[i] + es[i]
            nb += _nf(v)
            bs[i] = ds[i] * v
    else:
        for i in range(s):
            v = xs[i]
            nb += _nf(v)
            bs[i] = ds[i] * v
    m = s // 8
    b8 = buf[:s].reshape(m, 8)
    for g in range(m):
        _put8(b8, g, _r8(b8[g, 0], b8[g, 1], b8[g, 2], b8[g, 3],
                         b8[g, 4], b8[g, 5], b8[g, 6], b8[g, 7]))
    return nb


@njit(cache=True, nogil=True, inline="always")
def _load_plain(q, lo, s, buf):
    """``buf[:s] = q[lo:lo+s]`` with stages 1, 2, 4 applied (``s >= 8``)."""
    m = s // 8
    q8 = q[lo:lo + s].reshape(m, 8)
    b8 = buf[:s].reshape(m, 8)
    for g in range(m):
        _put8(b8, g, _r8(q8[g, 0], q8[g, 1], q8[g, 2], q8[g, 3],
                         q8[g, 4], q8[g, 5], q8[g, 6], q8[g, 7]))


@njit(cache=True, nogil=True)
def rotate(x, e, has_e, d, block, y):
    """``y = R (x + e)`` (``R x`` without ``e``), piece by piece.  Returns
    ``(bad_in, bad_out)``: the non-finite values of ``x + e`` and, where
    that is finite, of ``y`` (a rotation can overflow float32 only for
    entries near its maximum)."""
    n = x.size
    buf = np.empty(block, dtype=np.float32)
    bad_in = 0
    bad_out = 0
    lo = 0
    while lo < n:
        s = _piece(lo, n, block)
        c = _norm(s)
        no = 0
        if s >= _FAST:
            nb = _load_rotate(x, e, has_e, d, lo, s, buf)
            _middle(buf, s)
            h = s >> 1
            b0 = buf[:h]
            b1 = buf[h:s]
            y0 = y[lo:lo + h]
            y1 = y[lo + h:lo + s]
            for j in range(h):          # the last stage, normalised
                a = b0[j]
                b = b1[j]
                t0 = c * (a + b)
                t1 = c * (a - b)
                no += _nf(t0) + _nf(t1)
                y0[j] = t0
                y1[j] = t1
        else:
            nb = 0
            for i in range(s):
                v = x[lo + i] + e[lo + i] if has_e else x[lo + i]
                nb += _nf(v)
                buf[i] = d[i] * v
            _fwht(buf, s)
            for i in range(s):
                t = c * buf[i]
                no += _nf(t)
                y[lo + i] = t
        bad_in += nb
        if nb == 0:
            bad_out += no
        lo += s
    return bad_in, bad_out


@njit(cache=True, nogil=True)
def unrotate(y, d, block, out, add):
    """``out = R^T y`` (``out += R^T y`` with ``add``), piece by piece;
    ``out`` may be ``y`` itself."""
    n = y.size
    buf = np.empty(block, dtype=np.float32)
    lo = 0
    while lo < n:
        s = _piece(lo, n, block)
        c = _norm(s)
        if s >= _FAST:
            _load_plain(y, lo, s, buf)
            _middle(buf, s)
            h = s >> 1
            b0 = buf[:h]
            b1 = buf[h:s]
            d0 = d[:h]
            d1 = d[h:s]
            o0 = out[lo:lo + h]
            o1 = out[lo + h:lo + s]
            if add:
                for j in range(h):
                    a = b0[j]
                    b = b1[j]
                    o0[j] += d0[j] * (c * (a + b))
                    o1[j] += d1[j] * (c * (a - b))
            else:
                for j in range(h):
                    a = b0[j]
                    b = b1[j]
                    o0[j] = d0[j] * (c * (a + b))
                    o1[j] = d1[j] * (c * (a - b))
        else:
            for i in range(s):
                buf[i] = y[lo + i]
            _fwht(buf, s)
            if add:
                for i in range(s):
                    out[lo + i] += d[i] * (c * buf[i])
            else:
                for i in range(s):
                    out[lo + i] = d[i] * (c * buf[i])
        lo += s


@njit(cache=True, nogil=True)
def unrotate_residual(x, e, has_e, q, d, block, e_out):
    """``e_out = (x + e) - R^T q`` (``x - R^T q`` without ``e``): the
    residual of ``v = x + e`` against the decode of a rotated packet whose
    inner decode ``q`` is given, with the bits of :func:`unrotate` and a
    float32 subtraction.  ``q`` may be ``e_out`` itself."""
    n = x.size
    buf = np.empty(block, dtype=np.float32)
    lo = 0
    while lo < n:
        s = _piece(lo, n, block)
        c = _norm(s)
        if s >= _FAST:
            _load_plain(q, lo, s, buf)
            _middle(buf, s)
            h = s >> 1
            b0 = buf[:h]
            b1 = buf[h:s]
            d0 = d[:h]
            d1 = d[h:s]
            x0 = x[lo:lo + h]
            x1 = x[lo + h:lo + s]
            o0 = e_out[lo:lo + h]
            o1 = e_out[lo + h:lo + s]
            if has_e:
                e0 = e[lo:lo + h]
                e1 = e[lo + h:lo + s]
                for j in range(h):
                    a = b0[j]
                    b = b1[j]
                    o0[j] = (x0[j] + e0[j]) - d0[j] * (c * (a + b))
                    o1[j] = (x1[j] + e1[j]) - d1[j] * (c * (a - b))
            else:
                for j in range(h):
                    a = b0[j]
                    b = b1[j]
                    o0[j] = x0[j] - d0[j] * (c * (a + b))
                    o1[j] = x1[j] - d1[j] * (c * (a - b))
        else:
            for i in range(s):
                buf[i] = q[lo + i]
            _fwht(buf, s)
            for i in range(s):
                v = x[lo + i] + e[lo + i] if has_e else x[lo + i]
                e_out[lo + i] = v - d[i] * (c * buf[i])
        lo += s
