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

Import this module only where a GPU (or the simulator,
``NUMBA_ENABLE_CUDASIM=1``) is wanted: ``import hpccomm`` never imports
numba.cuda.
"""
from functools import partial

import numpy as np
from numba import config, cuda, int32

from .cuda_util import launch, to_device

#: threads per block (the simulator runs one Python thread per CUDA thread)
THREADS = 32 if config.ENABLE_CUDASIM else 256
#: rounds of THREADS elements per tile
ROUNDS = 4 if config.ENABLE_CUDASIM else 64
TILE = THREADS * ROUNDS


_device = to_device
_launch = partial(launch, THREADS)


# ---------------------------------------------------------------------------
# threshold compaction
# ---------------------------------------------------------------------------
@cuda.jit
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


@cuda.jit
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
    x = _device(x, np.float32)
    t = np.float32(t)
    tiles = (x.size + TILE - 1) // TILE
    counts = np.zeros(tiles, dtype=np.int64)
    if tiles:
        d_counts = cuda.to_device(counts)
        _count_tiles[tiles, THREADS](x, t, d_counts)
        counts = d_counts.copy_to_host()
    starts = np.zeros(tiles, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    m = int(counts.sum())
    idx = cuda.device_array(m, dtype=index_dtype)
    vals = cuda.device_array(m, dtype=np.float32)
    if m:
        _compact_tiles[tiles, THREADS](x, t, cuda.to_device(starts), idx, vals)
    return idx, vals


# ---------------------------------------------------------------------------
# Strom words and scatters
# ---------------------------------------------------------------------------
@cuda.jit
def _pack_sign_words(idx, vals, words):
    j = cuda.grid(1)
    if j < idx.size:
        w = np.uint64(idx[j]) << np.uint64(1)
        if vals[j] > 0:
            w |= np.uint64(1)
        words[j] = w


def pack_sign_words(idx, vals, word_dtype):
    """Strom words ``(idx << 1) | (vals > 0)`` as a device array of ``word_dtype``."""
    idx = _device(idx)
    vals = _device(vals, np.float32)
    words = cuda.device_array(idx.size, dtype=word_dtype)
    _launch(_pack_sign_words, idx.size, idx, vals, words)
    return words


@cuda.jit
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
    idx = _device(idx)
    vals = _device(vals, np.float32)
    _launch(_scatter, idx.size, out, idx, vals, add)
    return out


@cuda.jit
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
    words = _device(words)
    _launch(_scatter_sign_words, words.size, words, np.float32(tau), out, add)
    return out
