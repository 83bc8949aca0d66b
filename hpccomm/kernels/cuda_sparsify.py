"""GPU kernels (numba.cuda) of the sparsifying codecs.

Each function returns **the same values** as its CPU counterpart in
:mod:`hpccomm.kernels.sparsify` -- selections are in ascending index order
whatever the launch geometry, and decoding does one store (or one float32
add) per entry, exactly as on the CPU:

=======================  ==============================================
``select_abs_ge``        ``sparse.select_abs_ge`` (threshold compaction)
``pack_sign_words``      ``sparse.pack_sign_words`` (Strom words)
``scatter``              ``sparse.scatter`` (decode / decode-add)
``scatter_sign_words``   ``sparse.scatter_sign_words``
=======================  ==============================================

Arrays may be numpy arrays (copied to the device) or numba device arrays;
results are device arrays.  Like the CPU kernels these do no bounds checks:
indices and words handed to the scatters must have been validated (the
codecs validate packets on the host before decoding).

Compaction: a CUDA block owns a tile of ``TILE = threads * ROUNDS``
consecutive elements and walks it in rounds of one element per thread
(coalesced loads).  A first kernel counts each tile's candidates
(``syncthreads_count``); the host turns the counts into tile offsets (one
int64 per tile); a second kernel re-evaluates the predicate, scans it within
the block (Hillis-Steele in shared memory) and writes every candidate at its
tile offset plus its rank -- ascending index order.

Every launch, allocation and copy runs on the current stream
(:func:`hpccomm.kernels.cuda_util.current_stream`).
``tests/test_cuda_compile.py`` compiles every kernel for sm_90.

Import this module only where a GPU (or the simulator,
``NUMBA_ENABLE_CUDASIM=1``) is wanted: ``import hpccomm`` never imports
numba.cuda.
"""
from functools import partial

import numpy as np
from numba import config, cuda, int32, int64

from . import cuda_util as U

#: threads per block (the simulator runs each CUDA thread's code in Python)
THREADS = U.THREADS
#: rounds of THREADS elements per tile
ROUNDS = 4 if config.ENABLE_CUDASIM else 64
TILE = THREADS * ROUNDS


_launch = partial(U.launch, THREADS)


# ---------------------------------------------------------------------------
# threshold compaction
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _count_tiles(x, t, counts):
    n = x.size
    base = cuda.blockIdx.x * TILE
    tid = cuda.threadIdx.x
    total = 0
    for r in range(ROUNDS):
        first = base + r * THREADS
        if first >= n:  # the same for every thread of the block
            break
        i = first + tid
        hit = 0
        if i < n:
            v = x[i]
            if abs(v) >= t and v != 0:
                hit = 1
        total += cuda.syncthreads_count(hit)
    if tid == 0:
        counts[cuda.blockIdx.x] = total


@cuda.jit(cache=True)
def _compact_tiles(x, t, starts, idx, vals):
    scan = cuda.shared.array(THREADS, int32)
    n = x.size
    base = cuda.blockIdx.x * TILE
    tid = cuda.threadIdx.x
    k = starts[cuda.blockIdx.x]
    for r in range(ROUNDS):
        first = base + r * THREADS
        if first >= n:
            break
        i = first + tid
        hit = 0
        v = np.float32(0)
        if i < n:
            v = x[i]
            if abs(v) >= t and v != 0:
                hit = 1
        scan[tid] = hit
        cuda.syncthreads()
        step = 1
        while step < THREADS:  # inclusive scan
            add = scan[tid - step] if tid >= step else 0
            cuda.syncthreads()
            scan[tid] += add
            cuda.syncthreads()
            step *= 2
        if hit:
            pos = k + scan[tid] - 1
            idx[pos] = i
            vals[pos] = v
        k += scan[THREADS - 1]
        cuda.syncthreads()  # everyone has read scan[] before the next round


def select_abs_ge(x, t, index_dtype):
    """``(idx, vals)`` device arrays: every ``i`` with ``|x_i| >= t`` and
    ``x_i != 0``, ascending (see :func:`hpccomm.kernels.sparsify.select_abs_ge`)."""
    x = U.to_device(x, np.float32)
    t = np.float32(t)
    tiles = (x.size + TILE - 1) // TILE
    counts = np.zeros(tiles, dtype=np.int64)
    if tiles:                   # one block of THREADS per tile
        d_counts = U.to_device(counts)
        _launch(_count_tiles, tiles * THREADS, x, t, d_counts)
        counts = U.to_host(d_counts)
    starts = np.zeros(tiles, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    m = int(counts.sum())
    idx = U.empty(m, index_dtype)
    vals = U.empty(m, np.float32)
    if m:
        _launch(_compact_tiles, tiles * THREADS, x, t, U.to_device(starts), idx, vals)
    return idx, vals


# ---------------------------------------------------------------------------
# Strom words and scatters
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _pack_sign_words(idx, vals, words):
    j = cuda.grid(1)
    if j < idx.size:
        w = np.uint64(idx[j]) << np.uint64(1)
        if vals[j] > 0:
            w |= np.uint64(1)
        words[j] = w


def pack_sign_words(idx, vals, word_dtype):
    """Strom words ``(idx << 1) | (vals > 0)`` as a device array of ``word_dtype``."""
    idx = U.to_device(idx)
    vals = U.to_device(vals, np.float32)
    words = U.empty(idx.size, word_dtype)
    _launch(_pack_sign_words, idx.size, idx, vals, words)
    return words


@cuda.jit(cache=True)
def _scatter(out, idx, vals, add):
    j = cuda.grid(1)
    if j < idx.size:
        if add:
            out[idx[j]] += vals[j]
        else:
            out[idx[j]] = vals[j]


def scatter(out, idx, vals, add):
    """``out[idx] = vals`` (``add``: ``+=``) on a device array ``out``;
    ``idx`` validated (unique, in range)."""
    idx = U.to_device(idx)
    vals = U.to_device(vals, np.float32)
    _launch(_scatter, idx.size, out, idx, vals, add)
    return out


@cuda.jit(cache=True)
def _scatter_sign_words(words, tau, out, add):
    j = cuda.grid(1)
    if j < words.size:
        w = np.uint64(words[j])
        i = np.int64(w >> np.uint64(1))
        v = tau if (w & np.uint64(1)) else -tau
        if add:
            out[i] += v
        else:
            out[i] = v


def scatter_sign_words(words, tau, out, add):
    """``out[w >> 1] (+)= +tau or -tau`` on a device array ``out``; words validated."""
    words = U.to_device(words)
    _launch(_scatter_sign_words, words.size, words, np.float32(tau), out, add)
    return out


# ---------------------------------------------------------------------------
# top-k selection
#
# Kernels of the device twins of ``topk`` and ``dgc``
# (:mod:`hpccomm.device_codecs.topk`, :mod:`hpccomm.device_codecs.dgc`).  A
# block of TOPK_THREADS covers RUN_TILE = TOPK_THREADS * RUN consecutive
# elements, RUN per thread: the order-free kernels (compensate, gather,
# histograms, counts, scatters, checks) take element ``base + r *
# TOPK_THREADS + tid`` in round ``r`` (coalesced); the compaction gives each
# thread the contiguous run ``[base + tid * RUN, base + (tid + 1) * RUN)``,
# so that one serial scan of the per-thread counts by thread 0 orders the
# block's output by index (two syncthreads per block).
#
# Classes of an element ``v`` at threshold ``t`` (a float32 read from device
# memory, ``tf[0]``): *above* ``|v| > t``, *tie* ``|v| == t and v != 0``
# (NaN is neither).  Above + tie is the candidate set ``|v| >= t, v != 0`` of
# :func:`hpccomm.kernels.sparsify.select_abs_ge`.  :func:`compact_classes`
# keeps every above element and the first ``q`` ties in index order: with ``q
# = ALL`` the threshold compaction, with the exact ``k``-th largest magnitude
# and its tie count the host's ``keep_largest`` (ties to the lower index).
#
# Radix select (:func:`radix_select`): the ``k``-th largest of ``bits &
# 0x7FFFFFFF`` over a uint32 array (the magnitude's bit pattern of a float32
# view: ordered as the magnitudes, NaN above +inf as numpy sorts it) in three
# digit passes (11, 10, 10 bits); each builds an integer histogram of the
# elements whose higher digits match the prefix found so far (shared-memory
# atomics, then global atomics: integer counts, the same whatever the order)
# and one block picks the digit holding the ``k``-th largest and updates the
# state on the device: ``st[0]`` the bit pattern found so far, ``st[1]`` the
# rank still wanted inside it -- at the end the number of elements equal to
# the result that belong to the top ``k``.  Nothing comes to the host.
# ---------------------------------------------------------------------------
#: threads per block of the kernels below (the simulator: small blocks, so
#: that short test vectors span several blocks at little cost)
TOPK_THREADS = 8 if config.ENABLE_CUDASIM else 256
#: elements per thread of the kernels below
RUN = 16 if config.ENABLE_CUDASIM else 64
#: elements per block of the kernels below
RUN_TILE = TOPK_THREADS * RUN
#: "keep every tie" for :func:`compact_classes`
ALL = 1 << 62
_ABS = 0x7FFFFFFF
#: radix select digits over the 31 magnitude bits: (shift, width), most significant first
RADIX_DIGITS = ((20, 11), (10, 10), (0, 10))
#: histogram bins of the widest digit
RADIX_BINS = 2048


def run_tiles(count: int) -> int:
    """Blocks of :data:`RUN_TILE` elements covering ``count`` items."""
    return (count + RUN_TILE - 1) // RUN_TILE


def _launch_blocks(kernel, blocks, *args):
    U.launch(TOPK_THREADS, kernel, blocks * TOPK_THREADS, *args)


@cuda.jit(cache=True)
def _fill_runs(out, value):
    n = out.size
    base = cuda.blockIdx.x * RUN_TILE + cuda.threadIdx.x
    for r in range(RUN):
        i = base + r * TOPK_THREADS
        if i < n:
            out[i] = value


def fill_runs(out, value):
    """``out[:] = value`` (RUN elements per thread)."""
    _launch_blocks(_fill_runs, run_tiles(out.size), out, out.dtype.type(value))
    return out


@cuda.jit(cache=True)
def _compensate_runs(x, e, has_e, v, write_v, info):
    n = x.size
    base = cuda.blockIdx.x * RUN_TILE + cuda.threadIdx.x
    bad = 0
    for r in range(RUN):
        i = base + r * TOPK_THREADS
        if i < n:
            a = x[i]
            if has_e:
                a = a + e[i]
            if write_v:
                v[i] = a
            if a - a != 0:          # NaN or +-inf
                bad += 1
    if bad:
        cuda.atomic.add(info, 2, bad)


def compensate(x, e, v, info):
    """``v = x + e`` (``v = x`` for ``e=None``; nothing written for ``v=None``),
    one float32 addition per element, and ``info[2] +=`` the number of NaN/Inf
    in ``x + e`` (an integer count: order-free).  One pass."""
    _launch_blocks(_compensate_runs, run_tiles(x.size), x, x if e is None else e, e is not None,
                   x if v is None else v, v is not None, info)


@cuda.jit(cache=True)
def _gather_strided(bits, start, stride, out):
    s = out.size
    base = cuda.blockIdx.x * RUN_TILE + cuda.threadIdx.x
    for r in range(RUN):
        j = base + r * TOPK_THREADS
        if j < s:
            out[j] = bits[start + j * stride]


def gather_strided(bits, start, stride, out):
    """``out[j] = bits[start + j * stride]`` for ``j < out.size`` (the strided
    sample of :func:`hpccomm.kernels.sparsify.strided_sample_abs`, as raw bits:
    the radix select masks the sign)."""
    _launch_blocks(_gather_strided, run_tiles(out.size), bits, np.int64(start),
                   np.int64(stride), out)
    return out


@cuda.jit(cache=True)
def _radix_init(st, k, hist):
    tid = cuda.threadIdx.x
    if tid == 0:
        st[0] = 0
        st[1] = k
    for b in range(tid, hist.size, TOPK_THREADS):
        hist[b] = 0


@cuda.jit(cache=True)
def _radix_hist(bits, st, shift, width, hist):
    sh = cuda.shared.array(RADIX_BINS, int32)
    tid = cuda.threadIdx.x
    nb = 1 << width
    for b in range(tid, nb, TOPK_THREADS):
        sh[b] = 0
    cuda.syncthreads()
    top = shift + width
    want = st[0] >> top
    mask = nb - 1
    n = bits.size
    base = cuda.blockIdx.x * RUN_TILE + tid
    for r in range(RUN):
        i = base + r * TOPK_THREADS
        if i < n:
            u = np.int64(bits[i]) & _ABS
            if (u >> top) == want:
                cuda.atomic.add(sh, (u >> shift) & mask, 1)
    cuda.syncthreads()
    for b in range(tid, nb, TOPK_THREADS):
        c = sh[b]
        if c:
            cuda.atomic.add(hist, b, np.int64(c))


@cuda.jit(cache=True)
def _radix_pick(hist, shift, width, st):
    sums = cuda.shared.array(TOPK_THREADS, int64)
    tid = cuda.threadIdx.x
    chunk = (1 << width) // TOPK_THREADS
    lo = tid * chunk
    c = 0
    for b in range(lo, lo + chunk):
        c += hist[b]
    sums[tid] = c
    cuda.syncthreads()
    if tid == 0:
        rem = st[1]
        cum = 0
        t = TOPK_THREADS - 1            # the chunk holding the rem-th largest ...
        while t > 0 and cum + sums[t] < rem:
            cum += sums[t]
            t -= 1
        b = (t + 1) * chunk - 1         # ... and its bin
        while b > t * chunk and cum + hist[b] < rem:
            cum += hist[b]
            b -= 1
        st[0] = st[0] | (np.int64(b) << shift)
        st[1] = rem - cum
    cuda.syncthreads()
    for b in range(lo, lo + chunk):
        hist[b] = 0


def radix_select(bits, k, st, hist):
    """The ``k``-th largest of ``bits & 0x7FFFFFFF`` (``1 <= k <= bits.size``)
    into ``st[0]`` (int64; ``st.view(float32)[0]`` is the magnitude) and, in
    ``st[1]``, how many elements equal to it are among the ``k`` largest (the
    others above it number ``k - st[1]``).  ``hist``: int64 scratch of
    :data:`RADIX_BINS`.  Seven launches, three passes over ``bits``, nothing
    to the host."""
    _launch_blocks(_radix_init, 1, st, np.int64(k), hist)
    blocks = run_tiles(bits.size)
    for shift, width in RADIX_DIGITS:
        _launch_blocks(_radix_hist, blocks, bits, st, shift, width, hist)
        _launch_blocks(_radix_pick, 1, hist, shift, width, st)


@cuda.jit(cache=True)
def _count_classes(vals, tf, counts):
    sa = cuda.shared.array(TOPK_THREADS, int64)
    sb = cuda.shared.array(TOPK_THREADS, int64)
    t = tf[0]
    n = vals.size
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * RUN_TILE + tid
    a = 0
    b = 0
    for r in range(RUN):
        i = base + r * TOPK_THREADS
        if i < n:
            v = vals[i]
            m = abs(v)
            if m > t:
                a += 1
            elif m == t and v != 0:
                b += 1
    sa[tid] = a
    sb[tid] = b
    cuda.syncthreads()
    if tid == 0:
        ta = 0
        tb = 0
        for j in range(TOPK_THREADS):
            ta += sa[j]
            tb += sb[j]
        counts[2 * cuda.blockIdx.x] = ta
        counts[2 * cuda.blockIdx.x + 1] = tb


def count_classes(vals, tf, counts):
    """Per block of :data:`RUN_TILE` elements of ``vals``, the number of
    elements above ``tf[0]`` (``counts[2b]``) and of ties (``counts[2b + 1]``).
    One pass."""
    _launch_blocks(_count_classes, run_tiles(vals.size), vals, tf, counts)


@cuda.jit(cache=True)
def _compact_classes(vals, src, has_src, tf, q, tie_base, starts, out_idx, out_vals):
    sa = cuda.shared.array(TOPK_THREADS, int64)
    sb = cuda.shared.array(TOPK_THREADS, int64)
    t = tf[0]
    n = vals.size
    tid = cuda.threadIdx.x
    blk = cuda.blockIdx.x
    lo = blk * RUN_TILE + tid * RUN
    hi = lo + RUN
    if hi > n:
        hi = n
    a = 0
    b = 0
    for i in range(lo, hi):
        v = vals[i]
        m = abs(v)
        if m > t:
            a += 1
        elif m == t and v != 0:
            b += 1
    sa[tid] = a
    sb[tid] = b
    cuda.syncthreads()
    if tid == 0:                        # thread j's output start and first tie rank
        tb = tie_base[blk]
        pos = starts[blk]
        for j in range(TOPK_THREADS):
            aj = sa[j]
            bj = sb[j]
            keep = q - tb               # min(max(q - tb, 0), bj)
            if keep > bj:
                keep = bj
            if keep < 0:
                keep = 0
            sa[j] = pos
            sb[j] = tb
            pos += aj + keep
            tb += bj
    cuda.syncthreads()
    pos = sa[tid]
    tb = sb[tid]
    for i in range(lo, hi):
        v = vals[i]
        m = abs(v)
        keep = False
        if m > t:
            keep = True
        elif m == t and v != 0:
            keep = tb < q
            tb += 1
        if keep:
            if has_src:
                out_idx[pos] = src[i]
            else:
                out_idx[pos] = i
            out_vals[pos] = v
            pos += 1


def compact_classes(vals, src, tf, q, counts):
    """Plan the compaction of the above elements and the first ``q`` ties of
    ``vals`` (``counts``: the host copy of :func:`count_classes`' counts):
    returns ``(m, launch)``, the number kept and a function ``launch(out_idx,
    out_vals)`` writing them in index order -- the index ``src[i]`` of element
    ``i`` (``i`` itself for ``src=None``) and its value.  One int64 pair per
    block goes to the device (start and first tie rank)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1, 2)
    above, ties = counts[:, 0], counts[:, 1]
    tie_base = np.zeros(above.size, dtype=np.int64)
    np.cumsum(ties[:-1], out=tie_base[1:])
    kept = above + np.clip(q - tie_base, 0, ties)
    starts = np.zeros(above.size, dtype=np.int64)
    np.cumsum(kept[:-1], out=starts[1:])
    m = int(kept.sum())
    blocks = above.size

    def run(out_idx, out_vals):
        if m == 0:
            return
        plan = U.to_device(np.concatenate([starts, tie_base]))
        _launch_blocks(_compact_classes, blocks, vals, out_idx if src is None else src,
                       src is not None, tf, np.int64(q), plan[blocks:], plan[:blocks],
                       out_idx, out_vals)
    return m, run


@cuda.jit(cache=True)
def _scatter_runs(out, idx, vals, mode):
    m = idx.size
    base = cuda.blockIdx.x * RUN_TILE + cuda.threadIdx.x
    for r in range(RUN):
        j = base + r * TOPK_THREADS
        if j < m:
            i = idx[j]
            if mode == 0:
                out[i] = vals[j]
            elif mode == 1:
                out[i] = out[i] + vals[j]
            else:
                out[i] = out[i] - vals[j]


def scatter_runs(out, idx, vals, mode):
    """``out[idx] = vals`` (mode 0), ``+= vals`` (1) or ``-= vals`` (2), one
    float32 operation per entry; ``idx`` validated (unique, in range)."""
    _launch_blocks(_scatter_runs, run_tiles(idx.size), out, idx, vals, mode)
    return out


@cuda.jit(cache=True)
def _check_pairs(packet, idx, n, m, version, codec_id, flags, slot):
    tid = cuda.threadIdx.x
    if cuda.blockIdx.x == 0 and tid == 0:
        extra = 0
        for b in range(4):
            extra |= np.int64(packet[4 + b]) << (8 * b)
        count = 0
        for b in range(8):
            count |= np.int64(packet[8 + b]) << (8 * b)
        if (packet[0] != 72 or packet[1] != 67 or packet[2] != version
                or packet[3] != codec_id or extra != m or count != n):
            cuda.atomic.or_(flags, slot, 1)
    base = cuda.blockIdx.x * RUN_TILE + tid
    bad = 0
    for r in range(RUN):
        j = base + r * TOPK_THREADS
        if j < m:
            i = np.int64(idx[j])
            prev = np.int64(-1)
            if j > 0:
                prev = np.int64(idx[j - 1])
            if i <= prev or i >= n:
                bad = 1
    if bad:
        cuda.atomic.or_(flags, slot, 2)


def check_pairs(packet, idx, n, m, version, codec_id, flags, slot):
    """``flags[slot] |= 1`` when the header of the pair packet ``packet``
    disagrees with ``(version, codec_id, m, n)``, ``|= 2`` when its indices
    ``idx`` (``m`` of them) are not strictly increasing inside ``[0, n)``
    (:func:`hpccomm.kernels.sparsify.indices_valid`).  Writes nothing else."""
    _launch_blocks(_check_pairs, max(1, run_tiles(m)), packet, idx, np.int64(n), np.int64(m),
                   np.int64(version), np.int64(codec_id), flags, np.int64(slot))
