"""Sparse kernels: sorted merge-sum, scatter-add, densify, run-length coding,
fixed-capacity sparse records, and an affine permutation of index space.

A sparse vector here is a pair of arrays ``(idx, vals)``: ``idx`` strictly
increasing int32 or int64 global indices, ``vals`` float32 of the same length.
Every kernel is ``numba.njit(cache=True)`` and does **no bounds checks**: the
callers validate indices (range, order) before a kernel runs -- those from the
wire with :func:`first_unordered`, run-length blocks with :func:`rle_valid`.

Summation order is part of each kernel's contract, because the collectives
built on them promise bit-identical results on every rank:

* :func:`merge_sum` -- ``a[i] + b[i]`` with ``a`` the left operand where both
  streams hold ``i``; the value of the one stream that holds it otherwise.
* :func:`coalesce_sorted` -- runs of equal indices are summed left to right in
  the order given.
* :func:`scatter_add` -- ``out[i] += v`` in input order (``out`` left operand).

Run-length coding (Hofmann & Rünger style; :mod:`hpccomm.collectives.sparse.rle_pipeline`)
of a block of ``m`` float32 values is a ``uint32`` word array::

    word 0       nseg (number of segments), or RLE_DENSE (0xFFFFFFFF)
    RLE:         nseg x [zero_run, nz_run, nz_run float32 value bits]
                 (runs in elements; a trailing zero run is implicit)
    RLE_DENSE:   m float32 value bits

"Non-zero" runs are runs of *present* entries: an entry whose value is 0.0
(e.g. a sum that cancelled) stays in its run, which keeps merges free of
data-dependent re-compression.
"""
import numpy as np
from numba import njit

#: word 0 of a run-length block that carries its values densely
RLE_DENSE = np.uint32(0xFFFFFFFF)
_DENSE_WORD = 0xFFFFFFFF


# ---------------------------------------------------------------------------
# Sorted streams
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def first_unordered(idx, lo, hi):
    """The position of the first index of ``idx`` outside ``[lo, hi)`` or not
    above its predecessor; -1 when all are strictly increasing inside it."""
    prev = np.int64(lo) - 1
    for t in range(idx.size):
        i = np.int64(idx[t])
        if i <= prev or i >= hi:
            return t
        prev = i
    return -1


@njit(cache=True, nogil=True)
def merge_sum(ia, va, ib, vb):
    """Union of two strictly increasing streams; ``va + vb`` on common
    indices (``a`` is the left operand).  Returns new ``(idx, vals)``."""
    na, nb = ia.size, ib.size
    idx = np.empty(na + nb, dtype=ia.dtype)
    vals = np.empty(na + nb, dtype=np.float32)
    i = j = k = 0
    while i < na and j < nb:
        x, y = ia[i], ib[j]
        if x < y:
            idx[k] = x
            vals[k] = va[i]
            i += 1
        elif y < x:
            idx[k] = y
            vals[k] = vb[j]
            j += 1
        else:
            idx[k] = x
            vals[k] = va[i] + vb[j]
            i += 1
            j += 1
        k += 1
    while i < na:
        idx[k] = ia[i]
        vals[k] = va[i]
        i += 1
        k += 1
    while j < nb:
        idx[k] = ib[j]
        vals[k] = vb[j]
        j += 1
        k += 1
    return idx[:k].copy(), vals[:k].copy()


@njit(cache=True, nogil=True)
def coalesce_sorted(idx, vals):
    """Sum runs of equal indices of a non-decreasing ``idx``, left to right.
    Returns new ``(idx, vals)`` with strictly increasing indices."""
    n = idx.size
    out_i = np.empty(n, dtype=idx.dtype)
    out_v = np.empty(n, dtype=np.float32)
    k = -1
    for t in range(n):
        if k >= 0 and idx[t] == out_i[k]:
            out_v[k] += vals[t]
        else:
            k += 1
            out_i[k] = idx[t]
            out_v[k] = vals[t]
    return out_i[:k + 1].copy(), out_v[:k + 1].copy()


@njit(cache=True, nogil=True)
def scatter_add(out, idx, vals, offset):
    """``out[idx[t] - offset] += vals[t]`` for every ``t``, in order."""
    for t in range(idx.size):
        out[idx[t] - offset] += vals[t]


@njit(cache=True, nogil=True)
def scatter_set(out, idx, vals, offset):
    """``out[idx[t] - offset] = vals[t]`` for every ``t``."""
    for t in range(idx.size):
        out[idx[t] - offset] = vals[t]


@njit(cache=True, nogil=True)
def densify(idx, vals, lo, hi):
    """A float32 array for the range ``[lo, hi)`` holding ``vals`` at
    ``idx - lo`` and zeros elsewhere (``idx`` unique, inside the range)."""
    out = np.zeros(hi - lo, dtype=np.float32)
    scatter_set(out, idx, vals, lo)
    return out


@njit(cache=True, nogil=True)
def nonzeros(dense, lo, idx_dtype_probe):
    """``(idx, vals)`` of the non-zero entries of ``dense`` (which covers
    ``[lo, lo + dense.size)``); indices get the dtype of ``idx_dtype_probe``
    (a one-element array)."""
    count = 0
    for t in range(dense.size):
        if dense[t] != 0:
            count += 1
    idx = np.empty(count, dtype=idx_dtype_probe.dtype)
    vals = np.empty(count, dtype=np.float32)
    k = 0
    for t in range(dense.size):
        if dense[t] != 0:
            idx[k] = lo + t
            vals[k] = dense[t]
            k += 1
    return idx, vals


@njit(cache=True, nogil=True)
def drop_zeros(idx, vals):
    """The entries of a stream whose value is not 0.0 (copies)."""
    keep = 0
    for t in range(vals.size):
        if vals[t] != 0:
            keep += 1
    out_i = np.empty(keep, dtype=idx.dtype)
    out_v = np.empty(keep, dtype=np.float32)
    k = 0
    for t in range(vals.size):
        if vals[t] != 0:
            out_i[k] = idx[t]
            out_v[k] = vals[t]
            k += 1
    return out_i, out_v


# ---------------------------------------------------------------------------
# Run-length coding of blocks
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def rle_encode_pairs(idx, vals, lo, m):
    """RLE words of the block ``[lo, lo + m)`` holding the sorted pairs
    ``(idx, vals)`` (all inside the block).  Always the RLE form; the caller
    picks the dense form when it is not larger (:func:`rle_words_dense`)."""
    nnz = idx.size
    # count segments: a new one starts wherever an index does not follow its predecessor
    nseg = 0
    for t in range(nnz):
        if t == 0 or idx[t] != idx[t - 1] + 1:
            nseg += 1
    words = np.empty(1 + 2 * nseg + nnz, dtype=np.uint32)
    fwords = words.view(np.float32)
    words[0] = nseg
    w = 1
    pos = 0          # first element of the block not yet covered
    head = 0         # word index of the current segment's header
    for t in range(nnz):
        rel = idx[t] - lo
        if t == 0 or idx[t] != idx[t - 1] + 1:
            head = w
            words[head] = rel - pos
            words[head + 1] = 0
            w += 2
        words[head + 1] += 1
        fwords[w] = vals[t]
        w += 1
        pos = rel + 1
    return words


@njit(cache=True, nogil=True)
def rle_dense_words(dense):
    """The dense form of a block: ``[RLE_DENSE, values...]``."""
    words = np.empty(1 + dense.size, dtype=np.uint32)
    words[0] = _DENSE_WORD
    words[1:].view(np.float32)[:] = dense
    return words


@njit(cache=True, nogil=True)
def rle_valid(words, m):
    """Whether ``words`` is a whole RLE or dense block of ``m`` values: every
    run inside the block and every word read inside ``words``."""
    nw = words.size
    if nw == 0:
        return False
    if words[0] == _DENSE_WORD:
        return nw == 1 + m
    w = 1
    pos = np.int64(0)
    for _ in range(np.int64(words[0])):
        if w + 2 > nw:
            return False
        pos += np.int64(words[w])
        run = np.int64(words[w + 1])
        w += 2
        if pos + run > m or w + run > nw:
            return False
        w += run
        pos += run
    return w == nw


@njit(cache=True, nogil=True)
def rle_decode_into(words, out):
    """Overwrite ``out`` (the block's ``m`` float32 values) with an RLE or
    dense block."""
    m = out.size
    if words[0] == _DENSE_WORD:
        out[:] = words[1:1 + m].view(np.float32)
        return
    out[:] = 0
    fwords = words.view(np.float32)
    w = 1
    pos = 0
    for _ in range(words[0]):
        pos += words[w]
        run = words[w + 1]
        w += 2
        for t in range(run):
            out[pos + t] = fwords[w + t]
        w += run
        pos += run


@njit(cache=True, nogil=True)
def rle_decode(words, m):
    """Dense float32 values (a new array of length ``m``) of a block."""
    out = np.empty(m, dtype=np.float32)
    rle_decode_into(words, out)
    return out


@njit(cache=True, nogil=True)
def rle_add_into(words, dense):
    """``dense += block`` for an RLE or dense block (``dense`` left operand)."""
    if words[0] == _DENSE_WORD:
        dense += words[1:1 + dense.size].view(np.float32)
        return
    fwords = words.view(np.float32)
    w = 1
    pos = 0
    for _ in range(words[0]):
        pos += words[w]
        run = words[w + 1]
        w += 2
        for t in range(run):
            dense[pos + t] += fwords[w + t]
        w += run
        pos += run


@njit(cache=True, nogil=True, inline="always")
def _next_run(words, w, s, n, end, big):
    """The present run that follows in an RLE block: its segment's words start
    at ``w``, the previous run ended at ``end``, ``s`` of ``n`` segments are
    consumed.  Returns ``(r0, r1, v, s)`` -- the run ``[r0, r1)`` with values
    from word ``v`` -- or ``r0 = r1 = big`` when no segment is left."""
    if s < n:
        r0 = end + np.int64(words[w])
        return r0, r0 + np.int64(words[w + 1]), w + 2, s + 1
    return big, big, w, s


@njit(cache=True, nogil=True)
def rle_merge(a, b):
    """Merge-sum of two RLE blocks (neither dense) without decoding them:
    ``a + b`` where both hold an entry, ``a`` the left operand.  Returns RLE
    words (possibly larger than the dense form; the caller decides)."""
    fa = a.view(np.float32)
    fb = b.view(np.float32)
    # an upper bound on the output: every input entry and segment kept
    nnz_bound = a.size + b.size
    out = np.empty(1 + nnz_bound, dtype=np.uint32)
    fo = out.view(np.float32)
    # per operand: the current present run [r0, r1) with values at f[v + (p - r0)],
    # and the segment counter s of n segments
    na, nb = np.int64(a[0]), np.int64(b[0])
    big = np.int64(1) << 62
    ra0, ra1, va, sa = _next_run(a, np.int64(1), np.int64(0), na, np.int64(0), big)
    rb0, rb1, vb, sb = _next_run(b, np.int64(1), np.int64(0), nb, np.int64(0), big)
    nseg = 0
    w = 1
    head = -1
    last = np.int64(0)   # end of the output's last present run
    while ra0 < big or rb0 < big:
        p = min(ra0, rb0)
        # the next maximal stretch [p, q) where the set of present streams is constant
        if ra0 <= p and rb0 <= p:
            q = min(ra1, rb1)
        elif ra0 <= p:
            q = min(ra1, rb0)
        else:
            q = min(rb1, ra0)
        if head < 0 or p != last:
            head = w
            out[head] = p - last
            out[head + 1] = 0
            w += 2
            nseg += 1
        length = q - p
        out[head + 1] += length
        for t in range(length):
            pos = p + t
            if ra0 <= pos and rb0 <= pos:
                fo[w + t] = fa[va + (pos - ra0)] + fb[vb + (pos - rb0)]
            elif ra0 <= pos:
                fo[w + t] = fa[va + (pos - ra0)]
            else:
                fo[w + t] = fb[vb + (pos - rb0)]
        w += length
        last = q
        # advance the runs that ended at q, or trim the ones that continue
        if ra0 <= p:
            if ra1 == q:
                ra0, ra1, va, sa = _next_run(a, va + (ra1 - ra0), sa, na, ra1, big)
            else:
                va += q - ra0
                ra0 = q
        if rb0 <= p:
            if rb1 == q:
                rb0, rb1, vb, sb = _next_run(b, vb + (rb1 - rb0), sb, nb, rb1, big)
            else:
                vb += q - rb0
                rb0 = q
    out[0] = nseg
    return out[:w].copy()


@njit(cache=True, nogil=True)
def rle_to_pairs(words, lo, m, idx_dtype_probe):
    """``(idx, vals)`` of the present entries of a block starting at global
    index ``lo`` (a dense block yields its non-zero entries)."""
    if words[0] == _DENSE_WORD:
        return nonzeros(words[1:1 + m].view(np.float32), lo, idx_dtype_probe)
    fwords = words.view(np.float32)
    nseg = words[0]
    count = 0
    w = 1
    for _ in range(nseg):
        run = words[w + 1]
        count += run
        w += 2 + run
    idx = np.empty(count, dtype=idx_dtype_probe.dtype)
    vals = np.empty(count, dtype=np.float32)
    w = 1
    pos = lo
    k = 0
    for _ in range(nseg):
        pos += words[w]
        run = words[w + 1]
        w += 2
        for t in range(run):
            idx[k] = pos + t
            vals[k] = fwords[w + t]
            k += 1
        w += run
        pos += run
    return idx, vals


# ---------------------------------------------------------------------------
# Fixed-capacity sparse records (user-defined MPI_Op; see collectives.sparse.mpi_op)
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def record_merge(hdr_a, idx_a, val_a, dense_a, hdr_b, idx_b, val_b, dense_b, cap):
    """``b = a (+) b`` for two records, in place in ``b``.

    ``hdr = [count, dense flag]``; a sparse record holds ``count`` pairs in
    ``idx[:count]`` / ``val[:count]`` (capacity ``cap``); a dense record holds
    every value in ``dense``, which aliases the same bytes as ``idx``/``val``.
    The result is sparse while the union fits ``cap`` and dense otherwise.
    Every value of the result is a single ``x + y`` or a copy, and the union and
    the representation do not depend on the operand order: the merge is
    bitwise commutative.
    """
    a_dense = hdr_a[1] != 0
    b_dense = hdr_b[1] != 0
    if a_dense and b_dense:
        dense_b += dense_a
        return
    if b_dense:
        for t in range(hdr_a[0]):
            dense_b[idx_a[t]] += val_a[t]
        return
    # b sparse: take its pairs out first (the result may overwrite them)
    nb = hdr_b[0]
    ib = idx_b[:nb].copy()
    vb = val_b[:nb].copy()
    if a_dense:
        dense_b[:] = dense_a
        for t in range(nb):
            dense_b[ib[t]] += vb[t]
        hdr_b[0] = 0
        hdr_b[1] = 1
        return
    na = hdr_a[0]
    mi, mv = merge_sum(idx_a[:na], val_a[:na], ib, vb)
    if mi.size <= cap:
        idx_b[:mi.size] = mi
        val_b[:mi.size] = mv
        hdr_b[0] = mi.size
        return
    dense_b[:] = 0
    for t in range(mi.size):
        dense_b[mi[t]] = mv[t]
    hdr_b[0] = 0
    hdr_b[1] = 1


# ---------------------------------------------------------------------------
# A bijection of index space, for routing (kylix hash_indices=True)
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _mulmod(a, b, m):
    """``a * b mod m`` for uint64 ``a, b < m < 2**63`` without overflow."""
    if m <= np.uint64(0xFFFFFFFF):
        return (a * b) % m
    r = np.uint64(0)
    one = np.uint64(1)
    while b:
        if b & one:
            r += a
            if r >= m:
                r -= m
        a += a
        if a >= m:
            a -= m
        b >>= one
    return r


@njit(cache=True, nogil=True)
def affine_map(idx, mult, add, n):
    """``(mult * i + add) mod n`` for every ``i`` of ``idx`` (int64 result).
    A bijection of ``[0, n)`` when ``gcd(mult, n) == 1``."""
    out = np.empty(idx.size, dtype=np.int64)
    m = np.uint64(n)
    a = np.uint64(mult)
    c = np.uint64(add)
    for t in range(idx.size):
        v = _mulmod(a, np.uint64(idx[t]), m) + c
        if v >= m:
            v -= m
        out[t] = np.int64(v)
    return out
