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

The kernels are single-threaded loops over pieces; pieces are independent,
so the bits depend on the data, ``B`` and ``d`` alone.
"""
import numpy as np
from numba import njit

from .rng import hash_index_cpu

U64_63 = np.uint64(63)


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
    (``s`` a power of two)."""
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
        nb = 0
        for i in range(s):
            v = x[lo + i] + e[lo + i] if has_e else x[lo + i]
            if not np.isfinite(v):
                nb += 1
            buf[i] = d[i] * v
        _fwht(buf, s)
        c = _norm(s)
        no = 0
        for i in range(s):
            t = c * buf[i]
            if not np.isfinite(t):
                no += 1
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
        for i in range(s):
            buf[i] = y[lo + i]
        _fwht(buf, s)
        c = _norm(s)
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
        for i in range(s):
            buf[i] = q[lo + i]
        _fwht(buf, s)
        c = _norm(s)
        for i in range(s):
            v = x[lo + i] + e[lo + i] if has_e else x[lo + i]
            e_out[lo + i] = v - d[i] * (c * buf[i])
        lo += s
