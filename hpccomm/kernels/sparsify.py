"""CPU kernels of the sparsifying codecs: threshold, adaptive, topk, randk, dgc.

Plain numba ``@njit(cache=True, nogil=True)`` functions on flat, contiguous arrays.  They
do **no bounds checks**: the codecs validate every header field and size in
Python, and every index array a decoder scatters goes through a validating
kernel here (which returns a flag, so Python can raise
:class:`~hpccomm.errors.PacketError`) before any write happens.

Selection convention shared by all sparsifiers: an element is a candidate at
magnitude threshold ``t`` when ``|x_i| >= t`` **and** ``x_i != 0`` -- zeros
are never sent, whatever ``t`` is, and NaN never compares true, so it is never
selected.

Threads: the O(n) passes over the input (:func:`count_abs_ge`,
:func:`compact_abs_ge`, :func:`sum_squares`, :func:`compensate`) cut
``[0, n)`` into fixed blocks of :data:`BLOCK` elements and run blocks in
parallel (``prange``); every block's result lands in its own slot and slots
are combined in block order, so the output bits depend on neither the thread
count nor the schedule.  ``adaptive`` (:func:`adaptive_encode`) runs fixed
groups of columns in parallel, for the same reason.  Everything else is
sequential.  The work on one block is a function of its own, called from the
``prange`` loop rather than inlined into it: numba compiles it to tighter
loops that way (the sum of squares ran at half the speed inlined).

Random numbers: every draw comes from :mod:`hpccomm.kernels.rng`, with the
counters documented at each kernel.
"""
import threading
from contextlib import contextmanager

import numba
import numpy as np
from numba import njit, prange

from . import threads
from .masks import largest64, lowest_set_bit, most_negative64, outside_closed, outside_open
from .nonfinite import count_nonfinite
from .rng import hash_index_cpu

#: elements per block of the block-parallel passes (a multiple of 64)
BLOCK = 1 << 16


#: elements per chunk of the mask-driven compactions: one uint64 of flags,
#: formed by ``mask |= uint64(flag_j) << j`` inside a loop that also writes
#: the chunk (:func:`_compensate_chunk`), else by one vector compare
#: (:mod:`hpccomm.kernels.masks`), and walked by ``llvm.cttz``
CHUNK = 64

_U1 = np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _lowest_bit(mask):
    """``(j, rest)``: the position of the lowest set bit of the non-zero
    uint64 ``mask`` and ``mask`` without it."""
    return lowest_set_bit(mask), mask & (mask - _U1)


@contextmanager
def threads_for(n: int):
    """Run the block-parallel kernels on hpccomm's thread count
    (:mod:`hpccomm.kernels.threads`), or on one thread when ``n`` fits in one
    block: there is nothing to split, and starting numba's thread pool costs
    far more than the work -- measured with 4 ranks on 2 cores and numba's
    default 2 threads per rank (OpenMP layer): 57 ms per top-k selection of
    4096 elements, 0.18 ms on one thread.  The results do not depend on the
    thread count either way."""
    want = threads.get() if n > BLOCK else 1
    prev = numba.get_num_threads()
    if want == prev:
        yield
        return
    numba.set_num_threads(want)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


# ---------------------------------------------------------------------------
# Threshold selection: count, compact
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def count_abs_ge_blocks(x, t):
    """Per block of :data:`BLOCK` elements, the number of candidates
    ``|x_i| >= t and x_i != 0`` (int64 array of ``ceil(n / BLOCK)``)."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    counts = np.zeros(nb, dtype=np.int64)
    for b in prange(nb):
        counts[b] = _count_abs_ge_block(x[b * BLOCK:min((b + 1) * BLOCK, n)], t)
    return counts


@njit(cache=True, nogil=True, inline="always")
def _count_abs_ge_block(xb, t):
    """The candidates ``|x_i| >= t and x_i != 0`` of ``xb`` (one block).
    Loops over a slice from 0: numba then knows indices are >= 0 and the
    loop vectorizes (``range(lo, hi)`` on ``x`` does not)."""
    c = 0
    for i in range(xb.size):
        v = xb[i]
        c += (abs(v) >= t) & (v != 0)
    return c


def count_abs_ge(x, t):
    """Number of candidates ``|x_i| >= t and x_i != 0``."""
    if x.size <= BLOCK:     # one block: no parallel region (see select_abs_ge)
        return int(_count_abs_ge_block(x, np.float32(t)))
    with threads_for(x.size):
        return int(count_abs_ge_blocks(x, np.float32(t)).sum())


@njit(cache=True, nogil=True)
def _compact_block(xb, t, lo, idx, vals):
    """The candidates of ``xb`` (global indices from ``lo``) to ``idx`` /
    ``vals`` from 0 on, in index order.  Chunks of :data:`CHUNK` elements:
    the candidates' flags form a 64-bit mask (vectorized), whose set bits
    are visited lowest first -- no branch per element, whatever the
    density.  ``idx`` / ``vals`` hold exactly the candidates.

    A chunk's first candidate is taken without branching on the mask: slot
    ``k`` is written from the mask's lowest bit (bit 0 of an empty mask: a
    write that the next candidate or the final count discards) and ``k``
    advances by ``mask != 0``; a loop takes the rest.  Around 1 % density
    half of the chunks hold a candidate, and a branch on each mask
    mispredicted half the time: at 16M float32 and 1.2 %, 3.85 -> 2.51 ms
    on one thread (4.5 %: 5.2 -> 4.6 ms; 13 %: 5.7 -> 5.8 ms).  The other
    compactions do the same."""
    cap = idx.size
    body = xb.size - xb.size % CHUNK
    k = 0
    for c0 in range(0, body, CHUNK):
        q = xb[c0:c0 + CHUNK]
        mask = np.uint64(0)
        for j in range(CHUNK):
            v = q[j]
            mask |= np.uint64((abs(v) >= t) & (v != 0)) << np.uint64(j)
        # the first candidate without a branch on the mask
        real = mask != 0
        j, mask = _lowest_bit(mask)
        if k < cap:
            idx[k] = lo + c0 + j
            vals[k] = q[j]
        k += real
        while mask:
            j, mask = _lowest_bit(mask)
            idx[k] = lo + c0 + j
            vals[k] = q[j]
            k += 1
    for i in range(body, xb.size):
        v = xb[i]
        if abs(v) >= t and v != 0:
            idx[k] = lo + i
            vals[k] = v
            k += 1


@njit(cache=True, nogil=True, parallel=True)
def compact_abs_ge(x, t, starts, idx, vals):
    """Write the candidates of block ``b`` (see :func:`count_abs_ge_blocks`)
    to ``idx[starts[b]:starts[b + 1]]`` / ``vals[...]`` in index order
    (:func:`_compact_block`); ``starts`` is the exclusive prefix sum of the
    counts."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    for b in prange(nb):
        lo = b * BLOCK
        end = starts[b + 1] if b + 1 < nb else idx.size
        _compact_block(x[lo:min(lo + BLOCK, n)], t, lo, idx[starts[b]:end],
                       vals[starts[b]:end])


def select_abs_ge(x, t, index_dtype):
    """``(idx, vals)``: every ``i`` with ``|x_i| >= t and x_i != 0``, ascending,
    indices as ``index_dtype``, values float32.  An input of one block is
    counted and compacted by the blocks' own serial kernels, called directly:
    entering numba's parallel regions cost 14 us of the 15 that 512 elements
    took."""
    t = np.float32(t)
    if x.size <= BLOCK:
        m = int(_count_abs_ge_block(x, t))
        idx = np.empty(m, dtype=index_dtype)
        vals = np.empty(m, dtype=np.float32)
        if m:
            _compact_block(x, t, 0, idx, vals)
        return idx, vals
    with threads_for(x.size):
        counts = count_abs_ge_blocks(x, t)
        starts = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        m = int(counts.sum())
        idx = np.empty(m, dtype=index_dtype)
        vals = np.empty(m, dtype=np.float32)
        if m:
            compact_abs_ge(x, t, starts, idx, vals)
    return idx, vals


@njit(cache=True, nogil=True, inline="always")
def _compensate_chunk(xb, eb, has_e, vb, c0, t):
    """``v = xb + eb`` (``xb`` without ``has_e``) over the :data:`CHUNK`
    elements from ``c0``, written to ``vb``; returns ``(q, mask,
    nonfinite)``: the chunk of ``vb``, the 64-bit mask of its candidates
    ``|v| >= t and v != 0``, and whether any ``v`` is NaN or infinite (``v -
    v != 0``).  One loop that vectorizes: forming the mask from the chunk
    once written, a second loop, took 1.25x as long (16M, no candidates:
    11.6 against 9.3 ms; np.add of the same arrays 7.5 ms)."""
    q = vb[c0:c0 + CHUNK]
    xq = xb[c0:c0 + CHUNK]
    eq = eb[c0:c0 + CHUNK]
    mask = np.uint64(0)
    nonfinite = False
    for j in range(CHUNK):
        v = xq[j] + eq[j] if has_e else xq[j]
        q[j] = v
        nonfinite |= (v - v) != 0
        mask |= np.uint64((abs(v) >= t) & (v != 0)) << np.uint64(j)
    return q, mask, nonfinite


@njit(cache=True, nogil=True)
def _compensate_compact_block(xb, eb, has_e, t, vb, lo, idx, vals):
    """``vb = xb + eb`` (``xb`` without ``has_e``) and the candidates of
    ``vb`` at ``t`` (global indices from ``lo``) to ``idx`` / ``vals`` from
    0 on, in index order, at most ``idx.size`` of them; chunk by chunk of
    :data:`CHUNK` (:func:`_compensate_chunk`).  Returns ``(count,
    nonfinite)``: all candidates counted (beyond ``idx.size`` none is
    written), and whether any ``v`` is NaN or infinite (``v - v != 0``)."""
    cap = idx.size
    body = xb.size - xb.size % CHUNK
    k = 0
    nonfinite = False
    for c0 in range(0, body, CHUNK):
        q, mask, bad = _compensate_chunk(xb, eb, has_e, vb, c0, t)
        nonfinite |= bad
        real = mask != 0            # the first candidate: see _compact_block
        j, mask = _lowest_bit(mask)
        if k < cap:
            idx[k] = lo + c0 + j
            vals[k] = q[j]
        k += real
        while mask:
            j, mask = _lowest_bit(mask)
            if k < cap:
                idx[k] = lo + c0 + j
                vals[k] = q[j]
            k += 1
    for i in range(body, xb.size):
        v = xb[i] + eb[i] if has_e else xb[i]
        vb[i] = v
        nonfinite |= (v - v) != 0
        if abs(v) >= t and v != 0:
            if k < cap:
                idx[k] = lo + i
                vals[k] = v
            k += 1
    return k, nonfinite


@njit(cache=True, nogil=True, parallel=True)
def _compensate_select_blocks(x, e, has_e, t, v, idx, vals, cap):
    """:func:`_compensate_compact_block` of every block of :data:`BLOCK`, at
    most ``cap`` candidates to block ``b``'s range ``[b cap, (b + 1) cap)`` of
    ``idx`` / ``vals``; returns the per-block counts and non-finite flags."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    counts = np.zeros(nb, dtype=np.int64)
    flags = np.zeros(nb, dtype=np.bool_)
    for b in prange(nb):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        counts[b], flags[b] = _compensate_compact_block(
            x[lo:hi], e[lo:hi], has_e, t, v[lo:hi], lo,
            idx[b * cap:(b + 1) * cap], vals[b * cap:(b + 1) * cap])
    return counts, flags


@njit(cache=True, nogil=True)
def _join_blocks(v, t, src_idx, src_vals, counts, cap, idx, vals):
    """The blocks' candidates one after another into ``idx`` / ``vals``:
    copied from their ranges of ``src_*``, or, for a block with more than
    ``cap``, compacted again from ``v`` (:func:`_compact_block`)."""
    n = v.size
    o = 0
    for b in range(counts.size):
        c = counts[b]
        if c <= cap:
            idx[o:o + c] = src_idx[b * cap:b * cap + c]
            vals[o:o + c] = src_vals[b * cap:b * cap + c]
        else:
            lo = b * BLOCK
            _compact_block(v[lo:min(lo + BLOCK, n)], t, lo, idx[o:o + c], vals[o:o + c])
        o += c


_SCRATCH = threading.local()


def _scratch_pairs(size, index_dtype, use="pairs"):
    """``size`` indices (or words) and values of this thread's scratch for
    ``use``, kept from call to call (grown when too small): fresh memory
    would fault its pages in on every call (measured: 4 ms per 16M-element
    call for 6.7 MB).  Each use keeps its own, so that callers of different
    index types do not replace each other's."""
    have = getattr(_SCRATCH, use, None)
    if have is None or have[0].size < size or have[0].dtype != index_dtype:
        have = (np.empty(size, dtype=index_dtype), np.empty(size, dtype=np.float32))
        setattr(_SCRATCH, use, have)
    return have[0][:size], have[1][:size]


def compensate_select(x, e, v, t, index_dtype, fraction):
    """``v = x + e`` (``v = x`` for ``e=None``) and the candidates of ``v``
    at ``t`` in one pass over ``x`` and ``e``: ``(idx, vals, bad)``, the
    pairs of :func:`select_abs_ge` on ``v`` (the same bits) and the number
    of non-finite ``v`` (:func:`compensate`'s ``bad``).  ``fraction``: the
    share of elements expected to pass (e.g. the sample's); each block keeps
    up to four times that many candidates (at least 1024) in its own range
    of this thread's scratch (:func:`_scratch_pairs`: ``32 fraction n``
    bytes, held between calls), and a block with more is compacted again
    from ``v`` afterwards."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    cap = int(min(BLOCK, max(1024, 4 * fraction * BLOCK)))
    src_idx, src_vals = _scratch_pairs(nb * cap, index_dtype)
    t = np.float32(t)
    with threads_for(n):
        counts, flags = _compensate_select_blocks(x, x if e is None else e, e is not None,
                                                  t, v, src_idx, src_vals, cap)
    m = int(counts.sum())
    idx = np.empty(m, dtype=index_dtype)
    vals = np.empty(m, dtype=np.float32)
    _join_blocks(v, t, src_idx, src_vals, counts, cap, idx, vals)
    bad = count_nonfinite(v) if flags.any() else 0
    return idx, vals, bad


@njit(cache=True, nogil=True, inline="always")
def _take_sign_quantum(q, j, v, i, tau, words, vals, k):
    """Word ``i << 1 | (v > 0)`` and value ``v = q[j]`` to slot ``k``, and
    ``q[j] = v -+ tau`` (:func:`subtract_sign_quanta`'s bits); a select, not
    a branch, on the sign."""
    pos = v > 0
    words[k] = (np.uint64(i) << _U1) | np.uint64(pos)
    vals[k] = v
    d = tau if pos else -tau
    q[j] = v - d


@njit(cache=True, nogil=True)
def _sign_quanta_block(xb, eb, has_e, tau, vb, lo, words, vals):
    """``vb = xb + eb`` (``xb`` without ``has_e``) and, at the candidates of
    ``v`` at ``tau`` in index order, up to ``words.size`` of them: the word
    ``(lo + i) << 1 | (v > 0)``, ``v`` itself in ``vals``, and ``vb = v -+
    tau``; candidates beyond keep ``vb = v``.  Chunk by chunk of
    :data:`CHUNK` (:func:`_compensate_chunk`).  Returns ``(count,
    nonfinite)``: all candidates counted, and whether any ``v`` is NaN or
    infinite."""
    cap = words.size
    body = xb.size - xb.size % CHUNK
    k = 0
    nonfinite = False
    for c0 in range(0, body, CHUNK):
        q, mask, bad = _compensate_chunk(xb, eb, has_e, vb, c0, tau)
        nonfinite |= bad
        while mask:
            j, mask = _lowest_bit(mask)
            if k < cap:
                _take_sign_quantum(q, j, q[j], lo + c0 + j, tau, words, vals, k)
            k += 1
    for i in range(body, xb.size):
        v = xb[i] + eb[i] if has_e else xb[i]
        vb[i] = v
        nonfinite |= (v - v) != 0
        if abs(v) >= tau and v != 0:
            if k < cap:
                _take_sign_quantum(vb, i, v, lo + i, tau, words, vals, k)
            k += 1
    return k, nonfinite


@njit(cache=True, nogil=True, parallel=True)
def _sign_quanta_blocks(x, e, has_e, tau, v, words, vals, cap):
    """:func:`_sign_quanta_block` of every block of :data:`BLOCK`, block
    ``b``'s words and values to its range ``[b cap, (b + 1) cap)``; returns
    the per-block counts and non-finite flags."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    counts = np.zeros(nb, dtype=np.int64)
    flags = np.zeros(nb, dtype=np.bool_)
    for b in prange(nb):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        counts[b], flags[b] = _sign_quanta_block(
            x[lo:hi], e[lo:hi], has_e, tau, v[lo:hi], lo,
            words[b * cap:(b + 1) * cap], vals[b * cap:(b + 1) * cap])
    return counts, flags


@njit(cache=True, nogil=True)
def _restore_values(v, words, vals, counts, cap):
    """``v`` back to the compensated values at the entries
    :func:`_sign_quanta_block` took a quantum from."""
    for b in range(counts.size):
        for j in range(min(counts[b], cap)):
            v[np.int64(np.uint64(words[b * cap + j]) >> _U1)] = vals[b * cap + j]


def compensate_sign_quanta(x, e, v, tau, count_max, word_dtype):
    """Threshold's encode with error feedback in one pass over ``x`` and
    ``e`` (:func:`_sign_quanta_block`): ``v = x + e`` (``x`` for ``e=None``)
    with ``-+ tau`` taken at every candidate ``|v_i| >= tau`` (``v_i != 0``).
    Returns ``(write, m, bad)``: ``m`` candidates, ``bad`` non-finite ``v``,
    and ``write(words)`` puts their words ``(i << 1) | (v_i > 0)``, in index
    order, into ``words`` (``m`` of ``word_dtype``) -- the bits of
    :func:`compensate`, :func:`select_abs_ge`, :func:`pack_sign_words` and
    :func:`subtract_sign_quanta`.  ``write`` is None when there are more than
    ``count_max`` candidates, or more in a block than its share of the
    scratch (twice the average share of ``count_max``): ``v`` is then the
    plain ``x + e``, for the caller's capped selection.  Each block keeps
    its words and values in its own range of this thread's scratch (held
    between calls, as :func:`_scratch_pairs`): about ``16 count_max``
    bytes of address space, of which only the pages that entries reach are
    ever touched -- twice the words actually sent, in steady state."""
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    cap = int(min(BLOCK, max(1024, -(-2 * count_max * BLOCK // max(n, 1)))))
    words, vals = _scratch_pairs(nb * cap, word_dtype, "quanta")
    if nb <= 1:     # one block: its kernel called directly (see select_abs_ge)
        count, flag = _sign_quanta_block(x, x if e is None else e, e is not None,
                                         np.float32(tau), v, 0, words[:cap], vals[:cap])
        counts, flags = np.array([count], np.int64), np.array([flag])
    else:
        with threads_for(n):
            counts, flags = _sign_quanta_blocks(x, x if e is None else e, e is not None,
                                                np.float32(tau), v, words, vals, cap)
    m = int(counts.sum())
    bad = count_nonfinite(v) if flags.any() else 0
    if m > count_max or int(counts.max(initial=0)) > cap:
        _restore_values(v, words, vals, counts, cap)
        return None, m, bad
    return (lambda dst: _gather_groups(words, cap, counts, dst)), m, bad


def keep_largest(idx, vals, k):
    """The ``k`` entries of largest ``|vals|`` among ``(idx, vals)`` (sorted by
    index), ties at the cut going to the lower indices; the result stays
    sorted by index.  Returns the inputs themselves when ``k >= len``.

    From :data:`RADIX_MIN` float32 entries on, the cut is a radix selection
    over the bit patterns of ``|vals|`` (for non-negative floats, ordered as
    the values): a histogram of their high 16 bits, then of the low 16 bits
    of those in the bin that holds the ``k``-th largest (:func:`_radix_cut`),
    then one pass that keeps what lies above the cut and the first ties
    (:func:`_keep_above`).  Below, with a NaN among ``vals`` (``np.partition``
    counts NaN as the largest, and no comparison keeps it) or with other
    dtypes, numpy's partition and masks decide.  Measured, one thread
    (``m`` entries, ``k = m / 1.33``): 4096: 42 against 77 µs for the radix
    (zeroing and scanning its histograms); 16384: 150 against 76 µs;
    224K (``topk`` 1 % at 16M): 2.9 against 0.64 ms."""
    m = vals.size
    if k >= m:
        return idx, vals
    if k <= 0:
        return idx[:0], vals[:0]
    ties = -1
    if m >= RADIX_MIN and vals.dtype == np.float32 and vals.flags.c_contiguous:
        cut, ties = _radix_cut(vals, k)
    if ties < 0:
        mags = np.abs(vals)
        cut = np.partition(mags, m - k)[m - k]          # the k-th largest magnitude
        keep = mags > cut
        taken = np.flatnonzero(mags == cut)[:k - int(np.count_nonzero(keep))]
        keep[taken] = True
        return idx[keep], vals[keep]
    out_idx = np.empty(k + 1, idx.dtype)        # + 1: the last write of a skipped entry
    out_vals = np.empty(k + 1, np.float32)
    _keep_above(idx, vals, cut, ties, out_idx, out_vals)
    return out_idx[:k], out_vals[:k]


#: entries from which :func:`keep_largest` cuts by radix
RADIX_MIN = 8192
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_U16 = np.uint32(16)
_LOW16 = np.uint32(0xFFFF)


@njit(cache=True, nogil=True)
def _radix_cut(vals, k):
    """``(cut, ties)``: the bits of the ``k``-th largest ``|vals|`` (``0 < k
    < vals.size``) and how many entries equal to it the ``k`` largest
    hold; ``ties = -1`` when some ``vals`` is NaN.  Integer histograms:
    the result does not depend on the order they are filled in."""
    bits = vals.view(np.uint32)
    hist = np.zeros(1 << 16, np.int64)
    nan = 0
    for j in range(bits.size):
        b = bits[j] & _ABS
        nan += b > _INF
        hist[b >> _U16] += 1
    if nan:
        return np.uint32(0), -1
    need = k                    # entries still to take, from the top bin down
    hi = (1 << 15) - 1
    while hist[hi] < need:
        need -= hist[hi]
        hi -= 1
    hist[:] = 0
    for j in range(bits.size):
        b = bits[j] & _ABS
        if (b >> _U16) == hi:
            hist[b & _LOW16] += 1
    lo = (1 << 16) - 1
    while hist[lo] < need:
        need -= hist[lo]
        lo -= 1
    return (np.uint32(hi) << _U16) | np.uint32(lo), need


@njit(cache=True, nogil=True)
def _keep_above(idx, vals, cut, ties, out_idx, out_vals):
    """The entries whose ``|vals|`` bits lie above ``cut``, and the first
    ``ties`` equal to it, in order, to ``out_*`` (one slot longer than what
    is kept: every entry is written, and the next overwrites a skipped one)."""
    bits = vals.view(np.uint32)
    o = 0
    for j in range(bits.size):
        b = bits[j] & _ABS
        tie = (b == cut) & (ties > 0)
        ties -= tie
        out_idx[o] = idx[j]
        out_vals[o] = vals[j]
        o += (b > cut) | tie


# ---------------------------------------------------------------------------
# Reductions and sampling
# ---------------------------------------------------------------------------
#: independent float64 accumulators per block in :func:`sum_squares`: each
#: add waits for the previous one of its lane (4 cycles), so 8 lanes held the
#: sum to 2 elements per cycle (4.1 ms for 16M float32 on one thread); 32
#: run at memory speed (1.8 ms)
LANES = 32
#: rows of :data:`LANES` per step of :func:`_sum_squares_of`: the lane loop
#: then holds 4 sequential adds per lane, and LLVM vectorizes it across the
#: lanes instead of unrolling it (numba runs no SLP vectorizer)
ROWS = 4


@njit(cache=True, nogil=True)
def _sum_squares_of(xb):
    """``sum(xb_i^2)`` in float64: element ``i`` goes to accumulator
    ``acc[i mod LANES]``, the accumulators are added in lane order, then the
    tail beyond the last whole row of :data:`LANES`.  (:data:`ROWS` rows at
    a time, each lane's adds in index order; a call, not inlined, for the
    same reason.)"""
    group = ROWS * LANES
    full = xb.size - xb.size % group
    body = xb.size - xb.size % LANES
    acc = np.zeros(LANES)
    for r0 in range(0, full, group):
        for lane in range(LANES):
            a = acc[lane]
            for r in range(ROWS):
                v = np.float64(xb[r0 + r * LANES + lane])
                a += v * v
            acc[lane] = a
    for r0 in range(full, body, LANES):
        for lane in range(LANES):
            v = np.float64(xb[r0 + lane])
            acc[lane] += v * v
    s = 0.0
    for lane in range(LANES):
        s += acc[lane]
    for i in range(body, xb.size):
        v = np.float64(xb[i])
        s += v * v
    return s


@njit(cache=True, nogil=True, parallel=True)
def _block_sum_squares(x):
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    parts = np.zeros(nb, dtype=np.float64)
    for b in prange(nb):
        parts[b] = _sum_squares_of(x[b * BLOCK:min((b + 1) * BLOCK, n)])
    return parts


def sum_squares(x):
    """``sum(x_i^2)`` in float64, the same bits for any thread count (see
    :func:`_sum_squares`); one block's sum without a parallel region (see
    :func:`select_abs_ge`)."""
    if x.size <= BLOCK:
        return _sum_parts(np.array([_sum_squares_of(x)]))
    with threads_for(x.size):
        return _sum_squares(x)


@njit(cache=True, nogil=True)
def _sum_squares(x):
    """``sum(x_i^2)`` in float64 with a fixed summation order: within a block,
    element ``i`` goes to accumulator ``i mod LANES``, the accumulators are
    added in lane order, then the tail, then the blocks in order -- the same
    bits for any thread count (and fast: independent accumulators pipeline)."""
    return _sum_parts(_block_sum_squares(x))


@njit(cache=True, nogil=True)
def _sum_parts(parts):
    """``0.0 + parts[0] + parts[1] + ...`` in order."""
    s = 0.0
    for b in range(parts.size):
        s += parts[b]
    return s


# ---------------------------------------------------------------------------
# Error feedback: v = x + e formed in the new residual
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _compensate(xb, eb, has_e, vb):
    """``vb = xb + eb`` (``xb`` without ``has_e``); whether any ``v`` is
    non-finite (``v - v`` is NaN exactly for inf and NaN; an or, not a
    count: a 64-bit counter narrows the vector lanes)."""
    nonfinite = False
    if has_e:
        for i in range(xb.size):
            v = xb[i] + eb[i]
            vb[i] = v
            nonfinite |= (v - v) != 0
    else:
        for i in range(xb.size):
            v = xb[i]
            vb[i] = v
            nonfinite |= (v - v) != 0
    return nonfinite


@njit(cache=True, nogil=True, parallel=True)
def _compensate_blocks(x, e, has_e, squares, v):
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    flags = np.zeros(nb, dtype=np.bool_)
    parts = np.zeros(nb, dtype=np.float64)
    for b in prange(nb):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        vb = v[lo:hi]
        xb = x[lo:hi]
        flags[b] = _compensate(xb, e[lo:hi], has_e, vb)
        if squares:
            parts[b] = _sum_squares_of(xb)
    return flags, parts


def compensate(x, e, v, squares):
    """``v = x + e`` (``v = x`` for ``e=None``), block by block; returns
    ``(bad, ss)``: the number of non-finite ``v`` and, with ``squares``,
    ``sum_squares(x)`` of the fresh input (not of ``v``: threshold's
    ``alpha`` scales with it) -- the same bits, each block's sum taken while
    the block is in cache (0.0 without ``squares``)."""
    with threads_for(x.size):
        flags, parts = _compensate_blocks(x, x if e is None else e, e is not None, squares, v)
    bad = count_nonfinite(v) if flags.any() else 0
    return bad, (_sum_parts(parts) if squares else 0.0)


def strided_positions(n, s, key, counter):
    """The slice of ``s`` evenly strided positions ``start + j * stride`` of
    ``[0, n)`` (``stride = n // s``, ``j < s``), the start drawn as
    ``hash_index(key, counter) % stride``.  Requires ``1 <= s <= n``."""
    stride = n // s
    start = int(hash_index_cpu(key, np.uint64(counter)) % np.uint64(stride))
    return slice(start, start + stride * (s - 1) + 1, stride)


def strided_sample_abs(x, s, key, counter, e=None):
    """``|x|`` (``|x + e|`` with ``e``, the sum in float32) at the positions
    of :func:`strided_positions`."""
    at = strided_positions(x.size, s, key, counter)
    return np.abs(x[at] if e is None else x[at] + e[at])


def kth_largest(a, k):
    """The ``k``-th largest value of the magnitudes ``a`` (non-negative or
    NaN; ``1 <= k <= a.size``; NaN counts as the largest value).  numpy's
    introselect, called from Python: numba's ``np.partition`` takes 7-15x as
    long (25,600 float32: 187 against 16 us; 2^20: 4.3 against 0.60 ms;
    docs/data/i33/kth/selection.py).

    Introselect slows down on runs of equal values: 25,600 magnitudes of
    which 500 are non-zero took 1.8 ms against 0.12 ms for as many distinct
    ones.  Such samples are common -- the owner's sum of a few sparse
    packets before its residual fills, a sparse gradient -- so where at
    least half of ``a`` is zero, the answer comes from the non-zero values
    alone: 0 when fewer than ``k`` of them are non-zero, else their
    ``k``-th largest.  The same value either way."""
    nonzero = np.count_nonzero(a)
    if 2 * nonzero <= a.size:
        if nonzero < k:
            return a.dtype.type(0)
        a = a[a != 0]
    return np.partition(a, a.size - k)[a.size - k]


# ---------------------------------------------------------------------------
# Index validation and scatter (decoders)
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def indices_valid(idx, n):
    """True if ``idx`` is strictly increasing inside ``[0, n)``."""
    prev = -1
    for j in range(idx.size):
        i = np.int64(idx[j])
        if i <= prev or i >= n:
            return False
        prev = i
    return True


@njit(cache=True, nogil=True)
def subtract_at(out, idx, vals):
    """``out[idx] -= vals`` (indices distinct), in float32."""
    for j in range(idx.size):
        out[idx[j]] -= vals[j]


@njit(cache=True, nogil=True)
def scatter(out, idx, vals, add):
    """``out[idx] = vals`` (``add``: ``+=``); ``out`` is not cleared."""
    if add:
        for j in range(idx.size):
            out[idx[j]] += vals[j]
    else:
        for j in range(idx.size):
            out[idx[j]] = vals[j]


# ---------------------------------------------------------------------------
# Strom threshold words: (index << 1) | s, s = 1 for +tau
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def pack_sign_words(idx, vals, words):
    """``words[j] = (idx[j] << 1) | (vals[j] > 0)`` (uint32 or uint64 words)."""
    for j in range(idx.size):
        w = np.uint64(idx[j]) << np.uint64(1)
        if vals[j] > 0:
            w |= np.uint64(1)
        words[j] = w


@njit(cache=True, nogil=True)
def subtract_sign_quanta(e, idx, vals, tau):
    """``e[idx[j]] -= (tau if vals[j] > 0 else -tau)``: the new residual at
    the entries a threshold packet sends (what its words decode to there)."""
    neg = -tau
    for j in range(idx.size):
        i = idx[j]
        e[i] = e[i] - (tau if vals[j] > 0 else neg)


@njit(cache=True, nogil=True)
def sign_words_valid(words, n):
    """True if the indices ``words >> 1`` are strictly increasing inside ``[0, n)``."""
    prev = -1
    for j in range(words.size):
        i = np.int64(np.uint64(words[j]) >> np.uint64(1))
        if i <= prev or i >= n:
            return False
        prev = i
    return True


@njit(cache=True, nogil=True)
def scatter_sign_words(words, tau, out, add):
    """``out[w >> 1] (+)= +tau if w & 1 else -tau`` (validated words)."""
    neg = -tau
    for j in range(words.size):
        w = np.uint64(words[j])
        i = np.int64(w >> np.uint64(1))
        v = tau if (w & np.uint64(1)) else neg
        if add:
            out[i] += v
        else:
            out[i] = v


# ---------------------------------------------------------------------------
# Random-k: Floyd's sampling of k distinct indices out of n
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def floyd_indices(key, n, out):
    """Fill ``out`` with ``k = out.size`` distinct indices of ``[0, n)``,
    ascending, uniform over all ``k``-subsets (R. W. Floyd's algorithm).
    Draw ``j`` (for ``j = n - k .. n - 1``) is
    ``t = hash_index(key, j) % (j + 1)``; ``j`` itself is taken when ``t``
    already is.  A bitmap of ``n`` bits collects the set; scanning it yields
    the indices sorted."""
    k = out.size
    words = np.zeros((n + 63) // 64, dtype=np.uint64)
    one = np.uint64(1)
    for j in range(n - k, n):
        t = np.int64(hash_index_cpu(key, np.uint64(j)) % np.uint64(j + 1))
        if (words[t >> 6] >> np.uint64(t & 63)) & one:
            t = j
        words[t >> 6] |= one << np.uint64(t & 63)
    m = 0
    for w in range(words.size):
        bits = words[w]
        while bits:
            j, bits = _lowest_bit(bits)
            out[m] = w * 64 + j
            m += 1


# ---------------------------------------------------------------------------
# Adaptive (Dryden et al.): per-column thresholds, reconstruction means
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def adaptive_cap(h, pi, excess):
    """Hard bound on the entries of one sign in a column of ``h`` rows:
    ``min(h, excess * max(1, ceil(h / pi)))``."""
    return min(h, excess * max(1, (h + pi - 1) // pi))


@njit(cache=True, nogil=True, inline="always")
def _scaled_index(z, h):
    """``floor(z * h / 2**64)`` for 64-bit ``z`` and ``h < 2**32``: a uniform
    index of ``[0, h)`` from 64 random bits (Lemire's multiply-shift, the
    product split into 32-bit halves so it stays exact in uint64)."""
    hh = np.uint64(h)
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    return np.int64(((z >> s32) * hh + (((z & m32) * hh) >> s32)) >> s32)


@njit(cache=True, nogil=True)
def _kth_largest_inplace(a, m, k):
    """The ``k``-th largest of ``a[:m]`` (``1 <= k <= m``), reordering
    ``a[:m]``: Hoare's quickselect with a median-of-three pivot (no NaN)."""
    target = m - k  # its position in ascending order
    lo = 0
    hi = m - 1
    while lo < hi:
        x0, x1, x2 = a[lo], a[(lo + hi) >> 1], a[hi]
        p = max(min(x0, x1), min(max(x0, x1), x2))
        i = lo
        j = hi
        while i <= j:
            while a[i] < p:
                i += 1
            while a[j] > p:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return a[target]


#: up to this many kept values per sign, thresholds come from insertion into
#: a short sorted list (one predictable comparison per sample); beyond, from
#: a quickselect
SMALL_K = 64


@njit(cache=True, nogil=True, inline="always")
def _insert_desc(top, filled, k, v):
    """Insert ``v`` into ``top[:filled]`` (descending), keeping at most ``k``
    values; returns the new fill."""
    j = min(filled, k - 1)
    while j > 0 and top[j - 1] < v:
        top[j] = top[j - 1]
        j -= 1
    top[j] = v
    return min(filled + 1, k)


@njit(cache=True, nogil=True)
def _kth_largest_above(sample, k, top, sign):
    """The ``k``-th largest of the positive values ``sign * sample[j]``
    (there are at least ``k``), through a descending list ``top`` of the
    ``k`` largest so far: a value enters when it beats the bar, which rises
    to ``top[k - 1]`` once ``k`` are in.

    The bar starts just below the ``k``-th largest of the positive chunk
    maxima (:func:`~hpccomm.kernels.masks.largest64` /
    ``most_negative64`` of each full chunk of :data:`CHUNK`) when there are
    ``k`` of them -- ``k`` distinct values reach it, so the answer does too
    -- else at 0 (only positive values enter).  Chunk by chunk, a mask of
    the values beyond the bar as it stood at the chunk's start
    (:func:`~hpccomm.kernels.masks.outside_open`; a shorter last chunk
    whole) skips the rest: the bar only rises, so what the mask leaves out
    would not have entered.  NaN enters nowhere.  A Gaussian sample of 512
    with ``k = 4`` then inserts about 4 values per sign, where a bar from 0
    inserts about 20 and tests all 512: the thresholds of 4096 such samples
    took 2.5-3.0 ms against 4.3-6.0 (one thread)."""
    inf = np.float32(np.inf)
    bar = np.float32(0)
    full = sample.size // CHUNK
    if k <= full:
        filled = 0
        for c0 in range(0, full * CHUNK, CHUNK):
            m = largest64(sample, c0) if sign > 0 else -most_negative64(sample, c0)
            if m > 0:
                filled = _insert_desc(top, filled, k, m)
        if filled == k:
            bar = np.float32(np.nextafter(top[k - 1], np.float32(0)))
    filled = 0
    for c0 in range(0, sample.size, CHUNK):
        if c0 + CHUNK > sample.size:
            mask = (_U1 << np.uint64(sample.size - c0)) - _U1
        elif sign > 0:
            mask = outside_open(sample, c0, -inf, bar)
        else:
            mask = outside_open(sample, c0, -bar, inf)
        while mask:
            j, mask = _lowest_bit(mask)
            v = sign * sample[c0 + j]
            if v > bar:
                filled = _insert_desc(top, filled, k, v)
                if filled == k:
                    bar = top[k - 1]
    return top[k - 1]


@njit(cache=True, nogil=True)
def _sample_thresholds(sample, pi, pos, neg):
    """``(tau_pos, tau_neg)``: with the ``c`` positive values of ``sample``,
    ``tau_pos`` is the ``max(1, floor(c / pi))``-th largest; ``tau_neg`` the
    same over the negated negative values.  ``inf`` for a sign the sample
    lacks (nothing of that sign is sent).  ``pos`` / ``neg`` are scratch of
    ``sample.size + 1``."""
    cp = 0
    cn = 0
    for j in range(sample.size):
        v = sample[j]
        cp += v > 0
        cn += v < 0
    kp = max(1, cp // pi)
    kn = max(1, cn // pi)
    tp = np.float32(np.inf)
    tn = np.float32(np.inf)
    if max(kp, kn) <= SMALL_K:
        if cp:
            tp = _kth_largest_above(sample, kp, pos, np.float32(1))
        if cn:
            tn = _kth_largest_above(sample, kn, neg, np.float32(-1))
        return tp, tn
    # many kept values: split branch-free (every value is written to both
    # lists, the counters advance by the predicates), then quickselect
    cp = 0
    cn = 0
    for j in range(sample.size):
        v = sample[j]
        pos[cp] = v
        neg[cn] = -v
        cp += v > 0
        cn += v < 0
    if cp:
        tp = _kth_largest_inplace(pos, cp, kp)
    if cn:
        tn = _kth_largest_inplace(neg, cn, kn)
    return tp, tn


@njit(cache=True, nogil=True)
def _trim_side(col, tau, cap, sign):
    """The cut ``(t, q, total)`` that keeps the ``cap`` largest of the values
    ``v = sign * col[i] >= tau`` (of which there are more than ``cap``): every
    ``v > t`` plus the first ``q`` rows with ``v == t``; ``total`` is the
    float64 sum of the kept ``col[i]``."""
    sel = np.empty(col.size, dtype=np.float32)
    m = 0
    for i in range(col.size):
        v = col[i] * sign
        if v >= tau:
            sel[m] = v
            m += 1
    above = sel[:m].copy()
    t = _kth_largest_inplace(above, m, cap)
    n_above = 0
    for j in range(m):
        n_above += sel[j] > t
    q = cap - n_above
    total = 0.0
    seen = 0
    for i in range(col.size):
        v = col[i] * sign
        if v > t or (v == t and seen < q):
            seen += v == t
            total += np.float64(col[i])
    return t, q, total


@njit(cache=True, nogil=True)
def _column_thresholds(col, start, pi, samples, key, base, rows, drawn, pos, neg):
    """``(tau_pos, tau_neg)`` of one column whose first element is element
    ``start`` of the vector (:func:`_sample_thresholds`).

    Sampling: a column of ``h > samples`` rows draws ``samples`` rows with
    replacement, draw ``j`` taking row ``floor(z h / 2**64)`` with
    ``z = hash_index(key, offset + start + j)`` (``base = offset``; the
    counter is the global index of one of the column's own elements, so
    columns never share counters); shorter columns use all their rows (exact
    selection).  The rows are hashed in a loop of their own, which
    vectorizes, and gathered in a second: hashing and gathering in one loop
    took twice as long (16M, columns of 4096, 512 draws each: 4.2 against
    2.1 ms).  ``rows`` / ``drawn``: ``samples`` scratch; ``pos`` / ``neg``:
    one more."""
    h = col.size
    if h <= samples:
        return _sample_thresholds(col, pi, pos, neg)
    for j in range(samples):
        rows[j] = _scaled_index(hash_index_cpu(key, base + np.uint64(start + j)), h)
    for j in range(samples):
        drawn[j] = col[rows[j]]
    return _sample_thresholds(drawn, pi, pos, neg)


@njit(cache=True, nogil=True)
def _select_column(col, tp, tn, words, k):
    """The words ``(row << 1) | s`` of every row of ``col`` with
    ``v >= tp`` (``s = 1``) or ``v <= -tn`` (``s = 0``), rows ascending,
    from ``words[k]`` on -- those past the end of ``words`` all go to its
    last slot (more than fit only when a side is cut to its cap, and then
    the column is written again).  Returns ``(cp, cn, sp, sn)``: the count
    and the float64 row-order sum of each side.

    Chunks of :data:`CHUNK` rows through a 64-bit mask of candidates
    (:func:`~hpccomm.kernels.masks.outside_closed`; a shorter last chunk
    bit by bit); the sums add ``0.0`` for the other side, which changes
    nothing (``tp, tn > 0``, so a sum is never ``-0.0``)."""
    neg_bar = -tn
    lim = words.size - 1
    cp = 0
    cn = 0
    sp = 0.0
    sn = 0.0
    for c0 in range(0, col.size, CHUNK):
        if c0 + CHUNK <= col.size:
            mask = outside_closed(col, c0, neg_bar, tp)
        else:
            mask = np.uint64(0)
            for j in range(col.size - c0):
                v = col[c0 + j]
                mask |= np.uint64((v >= tp) | (v <= neg_bar)) << np.uint64(j)
        while mask:
            j, mask = _lowest_bit(mask)
            v = col[c0 + j]
            p = np.int64(v >= tp)
            words[min(k, lim)] = ((c0 + j) << 1) | p
            w = np.float64(v)
            k += 1
            cp += p
            cn += 1 - p
            sp += w if p else 0.0
            sn += 0.0 if p else w
    return cp, cn, sp, sn


@njit(cache=True, nogil=True)
def _write_column(col, tp, qp, tn, qn, words, k):
    """Words of the rows with ``v > tp`` or among the first ``qp`` with
    ``v == tp`` (``s = 1``), and likewise ``v < -tn`` / the first ``qn``
    with ``v == -tn`` (``s = 0``), rows ascending, from ``words[k]`` on."""
    neg_bar = -tn
    seen_p = 0
    seen_n = 0
    for i in range(col.size):
        v = col[i]
        if v >= tp:
            if v > tp or seen_p < qp:
                seen_p += v == tp
                words[k] = np.uint32((i << 1) | 1)
                k += 1
        elif v <= neg_bar:
            if v < neg_bar or seen_n < qn:
                seen_n += v == neg_bar
                words[k] = np.uint32(i << 1)
                k += 1


@njit(cache=True, nogil=True)
def _subtract_means(col, words, mp, mn):
    """``col[row] -= 0 + mu`` at the rows of ``words``: the residual where
    the column's packet decodes to ``mu_pos`` / ``mu_neg`` (added to zero,
    as the decoder does)."""
    dp = np.float32(0.0) + mp
    dn = np.float32(0.0) + mn
    for j in range(words.size):
        w = words[j]
        r = w >> 1
        col[r] = col[r] - (dp if w & 1 else dn)


@njit(cache=True, nogil=True)
def _any_nonfinite(v):
    nonfinite = False
    for i in range(v.size):
        nonfinite |= (v[i] - v[i]) != 0
    return nonfinite


@njit(cache=True, nogil=True)
def _count_nonfinite(v):
    bad = 0
    for i in range(v.size):
        bad += (v[i] - v[i]) != 0
    return bad


@njit(cache=True, nogil=True)
def _adaptive_group(x, e, has_e, feedback, H, c_lo, c_hi, pi, samples, excess, key, base,
                    e_out, counts, mu_pos, mu_neg, words):
    """Columns ``c_lo .. c_hi - 1`` (see :func:`adaptive_encode`), their
    words from ``words[0]`` on; returns ``(words written, non-finite v)``."""
    n = x.size
    rows = np.empty(min(samples, H), dtype=np.int64)
    drawn = np.empty(min(samples, H), dtype=np.float32)
    pos = np.empty(min(samples, H) + 1, dtype=np.float32)
    neg = np.empty(min(samples, H) + 1, dtype=np.float32)
    one = np.float32(1.0)
    bad = 0
    k = 0
    for c in range(c_lo, c_hi):
        lo = c * H
        hi = min(lo + H, n)
        h = hi - lo
        if feedback:
            col = e_out[lo:hi]
            nonfinite = _compensate(x[lo:hi], e[lo:hi], has_e, col)
        else:                         # the scan also brings the column into cache
            col = x[lo:hi]
            nonfinite = _any_nonfinite(col)
        if nonfinite:
            bad += _count_nonfinite(col)
        tp, tn = _column_thresholds(col, lo, pi, samples, key, base, rows, drawn, pos, neg)
        cp, cn, sp, sn = _select_column(col, tp, tn, words, k)
        cap = adaptive_cap(h, pi, excess)
        if cp > cap or cn > cap:      # cut a side to its cap, ties to lower rows
            qp = cp
            qn = cn
            if cp > cap:
                tp, qp, sp = _trim_side(col, tp, cap, one)
                cp = cap
            if cn > cap:
                tn, qn, sn = _trim_side(col, tn, cap, -one)
                cn = cap
            _write_column(col, tp, qp, tn, qn, words, k)
        mp = np.float32(sp / cp) if cp else np.float32(0.0)
        mn = np.float32(sn / cn) if cn else np.float32(0.0)
        counts[c] = cp + cn
        mu_pos[c] = mp
        mu_neg[c] = mn
        if feedback:
            _subtract_means(col, words[k:k + cp + cn], mp, mn)
        k += cp + cn
    return k, bad


def column_max(h, pi, excess):
    """The most entries a column of ``h`` rows sends: ``min(h, 2 cap(h))``."""
    return min(h, 2 * int(adaptive_cap(h, pi, excess)))


@njit(cache=True, nogil=True, parallel=True)
def _adaptive_encode(x, e, has_e, feedback, H, pi, samples, excess, key, offset, e_out,
                     counts, mu_pos, mu_neg, words, stride, used, bad):
    W = counts.size
    group = max(1, BLOCK // H)
    base = np.uint64(offset)
    for g in prange((W + group - 1) // group):
        used[g], bad[g] = _adaptive_group(
            x, e, has_e, feedback, H, g * group, min((g + 1) * group, W), pi, samples, excess,
            key, base, e_out, counts, mu_pos, mu_neg, words[g * stride:(g + 1) * stride])


@njit(cache=True, nogil=True)
def _gather_groups(words, stride, used, out):
    """Concatenate ``words[g * stride:][:used[g]]`` over the groups (or
    blocks: :func:`compensate_sign_quanta`'s words)."""
    k = 0
    for g in range(used.size):
        src = words[g * stride:g * stride + used[g]]
        for j in range(src.size):
            out[k + j] = src[j]
        k += src.size


def adaptive_encode(x, e, e_out, H, pi, samples, excess, key, offset):
    """Adaptive quantization of ``v`` in columns of ``H`` rows (the last one
    ragged), one column at a time while it is in cache: ``v = x`` (``e_out
    = None``), or with error feedback ``v = x + e`` (``v = x`` for ``e =
    None``) formed in ``e_out``, which becomes ``v - decode(packet)``.

    Per column: thresholds from the sample (:func:`_column_thresholds`),
    then one pass selecting ``{v >= tau_pos}`` and ``{v <= -tau_neg}`` with
    their counts and row-order float64 sums (:func:`_select_column`); a side
    with more than ``cap(h)`` entries keeps the ``cap`` largest, ties to
    lower rows (:func:`_trim_side`, every ``v > t`` plus the first ``q``
    rows with ``v == t``; the column's words are then written again).  The
    means are the sums over the counts rounded once to float32 (0 for an
    empty side); with feedback, ``e_out`` drops ``0 + mu`` at the sent rows
    only.  Columns go in fixed groups of about :data:`BLOCK` elements, groups
    in parallel; each group's words go to its own region of a scratch and
    are concatenated in order, so nothing depends on the threads.

    Returns ``(counts, mu_pos, mu_neg, words, bad)``: per column the entry
    count and the means, the words ``(row << 1) | s`` (``s = 1`` positive)
    column after column, and the number of non-finite ``v`` (a scan of each
    column before its draws, which then hit cache)."""
    n = x.size
    W = (n + H - 1) // H
    feedback = e_out is not None
    group = max(1, BLOCK // H)
    ngroups = (W + group - 1) // group
    stride = group * column_max(H, pi, excess) + 1
    counts = np.empty(W, dtype=np.int64)
    mu_pos = np.empty(W, dtype=np.float32)
    mu_neg = np.empty(W, dtype=np.float32)
    scratch = np.empty(ngroups * stride, dtype=np.uint32)
    used = np.empty(ngroups, dtype=np.int64)
    bad = np.empty(ngroups, dtype=np.int64)
    if ngroups == 1:    # one group: its kernel called directly (see select_abs_ge)
        used[0], bad[0] = _adaptive_group(
            x, x if e is None else e, e is not None, feedback, H, 0, W, pi, samples, excess, key,
            np.uint64(offset), x if e_out is None else e_out, counts, mu_pos, mu_neg, scratch)
    else:
        with threads_for(n):
            _adaptive_encode(x, x if e is None else e, e is not None, feedback, H, pi, samples,
                             excess, key, offset, x if e_out is None else e_out, counts, mu_pos,
                             mu_neg, scratch, stride, used, bad)
    words = np.empty(int(used.sum()), dtype=np.uint32)
    _gather_groups(scratch, stride, used, words)
    return counts, mu_pos, mu_neg, words, int(bad.sum())


@njit(cache=True, nogil=True)
def adaptive_valid(n, H, counts, words, pi, excess):
    """True if every column's words hold strictly increasing rows inside the
    column, at most :func:`adaptive_cap` entries of each sign, and the counts
    add up to ``words.size``."""
    W = counts.size
    k = 0
    for c in range(W):
        h = min(H, n - c * H)
        cap = adaptive_cap(h, pi, excess)
        cnt = np.int64(counts[c])
        if cnt > words.size - k:
            return False
        prev = -1
        npos = 0
        for j in range(k, k + cnt):
            w = np.int64(words[j])
            r = w >> 1
            if r <= prev or r >= h:
                return False
            prev = r
            npos += w & 1
        if npos > cap or cnt - npos > cap:
            return False
        k += cnt
    return k == words.size


@njit(cache=True, nogil=True)
def adaptive_scatter(n, H, counts, mu_pos, mu_neg, words, out, add):
    """Decode validated words: ``out[c H + row] (+)= mu_pos[c] or mu_neg[c]``;
    without ``add`` every element of ``out`` is written (zeros where nothing
    was sent)."""
    if not add:
        out[:] = 0
    k = 0
    for c in range(counts.size):
        lo = c * H
        for j in range(k, k + np.int64(counts[c])):
            w = np.int64(words[j])
            v = mu_pos[c] if w & 1 else mu_neg[c]
            out[lo + (w >> 1)] += v
        k += np.int64(counts[c])
