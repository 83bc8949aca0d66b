"""CPU kernels of PowerSGD's low-rank steps (:mod:`hpccomm.collectives.powersgd`).

A layer is a row-major float32 matrix ``M`` (``n`` rows, ``m`` columns), the
factors are float32 ``P`` (``n x r``) and ``Q`` (``m x r``).  Every product
accumulates in float64 in a fixed order and rounds once to float32, so the
results depend on the data alone -- not on the thread count, the tiling or
the machine (no fused multiply-adds: numba compiles without fast-math, and
LLVM does not contract a multiply and an add then):

* :func:`project` ``P = M Q``: row ``i`` of ``P`` is a dot product of row ``i``
  of ``M`` with each column of ``Q``, summed in :data:`LANES` float64 lanes
  (element ``j`` in lane ``j mod LANES``) combined by a fixed pairwise tree;
  rows are independent (parallel over rows);
* :func:`back_project` ``Q = M^T P``: column ``j`` of ``M`` against ``P``,
  summed over rows ``i = 0 .. n - 1`` in order (a float64 accumulator per
  ``(j, c)``, vectorised across ``j``); tiles of :data:`TILE` columns are
  independent (parallel over tiles);
* :func:`expand` ``out = P Q^T`` (and :func:`expand_pair`, two products that
  share ``P``): each element sums its ``r`` terms in order ``c = 0 .. r - 1``;
* :func:`orthogonalize`: modified Gram-Schmidt on the columns in float64, in
  column order (PyTorch's ``_orthogonalize_gram_schmidt``): column ``c`` is
  divided by its norm (plus ``eps``), then removed from every later column.
  A column whose norm is zero (``eps = 0``) is left zero rather than divided
  by zero: it then contributes nothing (PyTorch would produce NaN there);
* :func:`fill_uniform`: a factor's initial values, uniform in ``[-1, 1)``
  from the counter-based generator (:mod:`hpccomm.kernels.rng`), exact in
  float32 (``2 u - 1``) -- the same on every rank for the same key.

Square roots and divisions are IEEE-correctly rounded, so orthogonalising the
same bits gives the same bits everywhere.
"""
import numpy as np
from numba import njit, prange

from .rng import uniform01_cpu

#: float64 partial sums of :func:`project`'s dot products
LANES = 8
#: columns per parallel tile of :func:`back_project`
TILE = 256


#: rows of LANES elements per step of the lane loop (too many for LLVM to
#: unroll it fully: it vectorizes across the lanes instead, in the same order)
ROWS = 8


@njit(cache=True, nogil=True, inline="always")
def _dot_lanes(row, q, m, acc):
    """The dot product of ``row[:m]`` (float32) and ``q[:m]`` (float64) in
    LANES lanes (element ``j`` in lane ``j mod LANES``, in index order),
    combined by a fixed pairwise tree; ``acc``: LANES float64 scratch."""
    for k in range(LANES):
        acc[k] = 0.0
    g = ROWS * LANES
    full = m - m % g
    for j0 in range(0, full, g):
        for rr in range(ROWS):
            base = j0 + rr * LANES
            for k in range(LANES):
                acc[k] += np.float64(row[base + k]) * q[base + k]
    body = m - m % LANES
    for base in range(full, body, LANES):
        for k in range(LANES):
            acc[k] += np.float64(row[base + k]) * q[base + k]
    for j in range(body, m):
        acc[j - body] += np.float64(row[j]) * q[j]
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(cache=True, nogil=True)
def _columns64(Q):
    """The columns of float32 ``Q`` (m x r) as float64 rows (r x m)."""
    m, r = Q.shape
    Qt = np.empty((r, m), dtype=np.float64)
    for j in range(m):
        for c in range(r):
            Qt[c, j] = np.float64(Q[j, c])
    return Qt


@njit(cache=True, nogil=True, parallel=True)
def project(M, Q, P):
    """``P = M Q`` (``M`` n x m, ``Q`` m x r, ``P`` n x r; float32)."""
    n, m = M.shape
    r = Q.shape[1]
    Qt = _columns64(Q)
    for i in prange(n):
        acc = np.empty(LANES, dtype=np.float64)
        for c in range(r):
            P[i, c] = np.float32(_dot_lanes(M[i], Qt[c], m, acc))


@njit(cache=True, nogil=True, parallel=True)
def back_project(M, P, Q):
    """``Q = M^T P`` (``M`` n x m, ``P`` n x r, ``Q`` m x r; float32)."""
    n, m = M.shape
    r = P.shape[1]
    ntiles = (m + TILE - 1) // TILE
    for t in prange(ntiles):
        j0 = t * TILE
        j1 = min(j0 + TILE, m)
        w = j1 - j0
        acc = np.zeros((r, TILE), dtype=np.float64)
        for i in range(n):
            for c in range(r):
                p = np.float64(P[i, c])
                for j in range(w):
                    acc[c, j] += np.float64(M[i, j0 + j]) * p
        for j in range(w):
            for c in range(r):
                Q[j0 + j, c] = np.float32(acc[c, j])


@njit(cache=True, nogil=True, parallel=True)
def expand(P, Q, out):
    """``out = P Q^T`` (``P`` n x r, ``Q`` m x r, ``out`` n x m; float32)."""
    n, r = P.shape
    m = Q.shape[0]
    Qt = _columns64(Q)
    for i in prange(n):
        acc = np.zeros(m, dtype=np.float64)
        for c in range(r):
            p = np.float64(P[i, c])
            q = Qt[c]
            for j in range(m):
                acc[j] += p * q[j]
        o = out[i]
        for j in range(m):
            o[j] = np.float32(acc[j])


@njit(cache=True, nogil=True, parallel=True)
def expand_pair(P, Q1, Q2, out1, out2):
    """``out1 = P Q1^T`` and ``out2 = P Q2^T`` in one pass over ``P``'s rows,
    each with :func:`expand`'s bits."""
    n, r = P.shape
    m = Q1.shape[0]
    Q1t = _columns64(Q1)
    Q2t = _columns64(Q2)
    for i in prange(n):
        a1 = np.zeros(m, dtype=np.float64)
        a2 = np.zeros(m, dtype=np.float64)
        for c in range(r):
            p = np.float64(P[i, c])
            q1 = Q1t[c]
            q2 = Q2t[c]
            for j in range(m):
                a1[j] += p * q1[j]
                a2[j] += p * q2[j]
        o1 = out1[i]
        o2 = out2[i]
        for j in range(m):
            o1[j] = np.float32(a1[j])
            o2[j] = np.float32(a2[j])


@njit(cache=True, nogil=True)
def orthogonalize(A, eps):
    """Modified Gram-Schmidt on the columns of float32 ``A`` (k x r), in
    place, computed in float64 (see the module docstring); returns the
    number of columns left zero."""
    k, r = A.shape
    W = np.empty((r, k), dtype=np.float64)
    for i in range(k):
        for c in range(r):
            W[c, i] = np.float64(A[i, c])
    zero = 0
    for c in range(r):
        col = W[c]
        s = 0.0
        for i in range(k):
            s += col[i] * col[i]
        norm = np.sqrt(s) + eps
        if norm == 0.0:
            zero += 1
            for i in range(k):
                col[i] = 0.0
        else:
            for i in range(k):
                col[i] = col[i] / norm
        for d in range(c + 1, r):
            other = W[d]
            dot = 0.0
            for i in range(k):
                dot += col[i] * other[i]
            for i in range(k):
                other[i] -= dot * col[i]
    for i in range(k):
        for c in range(r):
            A[i, c] = np.float32(W[c, i])
    return zero


@njit(cache=True, nogil=True)
def fill_uniform(key, out):
    """``out[i] = 2 uniform01(key, i) - 1`` over the flat float32 ``out``."""
    flat = out.reshape(-1)
    for i in range(flat.size):
        flat[i] = np.float32(2.0) * uniform01_cpu(key, np.uint64(i)) - np.float32(1.0)
