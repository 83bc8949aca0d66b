"""GPU kernels (numba.cuda) of the quantizing codecs.

Each function here produces **the same bytes** as its CPU counterpart in
:mod:`hpccomm.kernels.quantize` (same counter-based random numbers, same
float32 / float64 operations in the same order), so packets do not depend
on the device:

=====================  ==============================================
``onebit_means``       the ``means`` of ``quantize.onebit_encode``
``onebit_pack``        its sign ``words``
``onebit_unpack``      ``quantize.onebit_decode``
``tern_pack``          ``quantize.tern_pack``
``qsgd_scales``        ``quantize.bucket_scales``
``qsgd_pack``          the codes of ``quantize.qsgd_encode``, given scales
``codes_decode``       ``quantize.codes_decode``
=====================  ==============================================

(TernGrad's scale ``s`` -- a max and a standard deviation over the whole
vector -- is an input here.)  Arrays may be numpy arrays (copied to the
device) or numba device arrays; results are device arrays.  One thread per
output word, byte, element or (for the sums) bucket / column, so sums keep
the CPU's sequential lane order.

On real GPUs NVVM contracts a multiply followed by an add into a fused
multiply-add by default, which rounds once instead of twice: products that
feed an addition therefore go through ``libdevice.dmul_rn`` (never fused).
The tests run on the simulator (``NUMBA_ENABLE_CUDASIM=1``), which executes
the kernels as Python with plain IEEE arithmetic; these kernels have not yet
run on a real GPU.

Import this module only where a GPU (or the simulator) is wanted: ``import
hpccomm`` never imports numba.cuda.
"""
import math
from functools import partial

import numpy as np
from numba import config, cuda

from .cuda_util import launch, to_device
from .quantize import F32_MAX, LANES
from .rng import uniform01

_uniform01 = cuda.jit(device=True)(uniform01)
#: threads per block (the simulator runs one Python thread per CUDA thread)
_THREADS = 32 if config.ENABLE_CUDASIM else 128

if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def _dmul_rn(a, b):
        return a * b
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _dmul_rn(a, b):
        return libdevice.dmul_rn(a, b)


_device = to_device
_launch = partial(launch, _THREADS)


# ---------------------------------------------------------------------------
# lane sums (same order as quantize._lane_total)
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _lane_total(acc):
    w = LANES // 2
    while w >= 1:
        for k in range(w):
            acc[k] += acc[k + w]
        w //= 2
    return acc[0]


# ---------------------------------------------------------------------------
# onebit
# ---------------------------------------------------------------------------
@cuda.jit
def _onebit_means_kernel(x, col_len, means):
    c = cuda.grid(1)
    if c >= means.size // 2:
        return
    n = x.size
    lo = c * col_len
    hi = min(lo + col_len, n)
    pos = cuda.local.array(LANES, np.float64)
    neg = cuda.local.array(LANES, np.float64)
    for k in range(LANES):
        pos[k] = 0.0
        neg[k] = 0.0
    npos = 0
    for i in range(lo, hi):
        v = np.float64(x[i])
        k = (i - lo) % LANES
        if v >= 0:
            pos[k] += v
            neg[k] += v - v
            npos += 1
        else:
            neg[k] += v
    means[2 * c] = _lane_total(pos) / max(npos, 1)
    means[2 * c + 1] = _lane_total(neg) / max(hi - lo - npos, 1)


@cuda.jit
def _onebit_pack_kernel(x, words):
    w = cuda.grid(1)
    if w >= words.size:
        return
    n = x.size
    word = 0
    for k in range(32):
        i = 32 * w + k
        if i < n and x[i] >= 0:
            word |= 1 << k
    words[w] = word


@cuda.jit
def _onebit_unpack_kernel(words, means, col_len, out, add):
    i = cuda.grid(1)
    if i >= out.size:
        return
    c = i // col_len
    v = means[2 * c] if (words[i >> 5] >> (i & 31)) & 1 else means[2 * c + 1]
    if add:
        out[i] += v
    else:
        out[i] = v


def onebit_means(x, col_len):
    """Per-column ``(mu_pos, mu_neg)`` pairs (float32, ``2 ceil(n / col_len)``)."""
    x = _device(x, np.float32)
    means = cuda.device_array(2 * (-(-x.size // col_len)), dtype=np.float32)
    _launch(_onebit_means_kernel, means.size // 2, x, col_len, means)
    return means


def onebit_pack(x):
    """Sign bits of ``x``: uint32 words, element ``i`` at bit ``i mod 32``."""
    x = _device(x, np.float32)
    words = cuda.device_array(-(-x.size // 32), dtype=np.uint32)
    _launch(_onebit_pack_kernel, words.size, x, words)
    return words


def onebit_unpack(words, means, col_len, n, out=None, add=False):
    """Decode sign ``words`` with per-column ``means`` into ``out`` (n float32)."""
    out = cuda.device_array(n, dtype=np.float32) if out is None else _device(out, np.float32)
    _launch(_onebit_unpack_kernel, n, _device(words, np.uint32), _device(means, np.float32),
            col_len, out, add)
    return out


# ---------------------------------------------------------------------------
# terngrad / qsgd: b-bit two's complement codes
# ---------------------------------------------------------------------------
@cuda.jit
def _tern_pack_kernel(x, key, offset, scale, clip, packed):
    j = cuda.grid(1)
    if j >= packed.size:
        return
    n = x.size
    byte = 0
    for k in range(4):
        i = 4 * j + k
        if i < n:
            v = x[i]
            u = _uniform01(key, np.uint64(offset + i))
            if u * scale < min(abs(v), clip):
                byte |= (1 if v > 0 else 3) << (2 * k)
    packed[j] = byte


@cuda.jit(device=True)
def _ratio(scale, levels):
    if scale > 0 and scale < math.inf:
        return levels / np.float64(scale)
    return 0.0


@cuda.jit
def _qsgd_scales_kernel(x, bucket, use_max, scales):
    j = cuda.grid(1)
    if j >= scales.size:
        return
    lo = j * bucket
    hi = min(lo + bucket, x.size)
    if use_max:
        r = np.float64(0.0)
        nan = False
        for i in range(lo, hi):
            a = np.float64(abs(x[i]))
            if a > r:
                r = a
            if a != a:
                nan = True
        scales[j] = math.nan if nan else r
        return
    acc = cuda.local.array(LANES, np.float64)
    for k in range(LANES):
        acc[k] = 0.0
    for i in range(lo, hi):
        v = np.float64(x[i])
        acc[(i - lo) % LANES] += _dmul_rn(v, v)
    r = math.sqrt(_lane_total(acc))
    if r > F32_MAX and r < math.inf:
        r = F32_MAX
    scales[j] = r


@cuda.jit
def _qsgd_pack_kernel(x, scales, bucket, bits, levels, key, offset, packed):
    j = cuda.grid(1)
    if j >= packed.size:
        return
    n = x.size
    per = 8 // bits
    mask = (1 << bits) - 1
    byte = 0
    for k in range(per):
        i = per * j + k
        if i < n:
            v = x[i]
            u = _uniform01(key, np.uint64(offset + i))
            ratio = _ratio(scales[i // bucket], levels)
            q = min(int(_dmul_rn(abs(np.float64(v)), ratio) + u), levels)
            if v < 0:
                q = -q
            byte |= (q & mask) << (bits * k)
    packed[j] = byte


@cuda.jit
def _codes_decode_kernel(packed, bits, bucket, levels, scales, out, add):
    i = cuda.grid(1)
    if i >= out.size:
        return
    half = 1 << (bits - 1)
    raw = (np.int64(packed[(i * bits) >> 3]) >> ((i * bits) & 7)) & ((1 << bits) - 1)
    q = (raw ^ half) - half
    v = np.float32(q * (np.float64(scales[i // bucket]) / levels))
    if add:
        out[i] += v
    else:
        out[i] = v


def tern_pack(x, key, offset, scale, clip):
    """TernGrad codes of ``x``, 2-bit packed (``ceil(n / 4)`` bytes)."""
    x = _device(x, np.float32)
    packed = cuda.device_array(-(-x.size // 4), dtype=np.uint8)
    _launch(_tern_pack_kernel, packed.size, x, np.uint64(key), int(offset), np.float32(scale),
            np.float32(clip), packed)
    return packed


def qsgd_scales(x, bucket, use_max):
    """Per-bucket QSGD scales (float32, ``ceil(n / bucket)``)."""
    x = _device(x, np.float32)
    scales = cuda.device_array(-(-x.size // bucket), dtype=np.float32)
    _launch(_qsgd_scales_kernel, scales.size, x, bucket, bool(use_max), scales)
    return scales


def qsgd_pack(x, scales, bucket, bits, key, offset):
    """QSGD codes of ``x`` against per-bucket ``scales``, ``bits``-bit packed
    (``ceil(n bits / 8)`` bytes)."""
    x = _device(x, np.float32)
    packed = cuda.device_array(-(-(x.size * bits) // 8), dtype=np.uint8)
    _launch(_qsgd_pack_kernel, packed.size, x, _device(scales, np.float32), bucket, bits,
            2 ** (bits - 1) - 1, np.uint64(key), int(offset), packed)
    return packed


def codes_decode(packed, bits, bucket, levels, scales, n, out=None, add=False):
    """Dense float32 values of packed ``bits``-bit codes (``n`` elements)."""
    out = cuda.device_array(n, dtype=np.float32) if out is None else _device(out, np.float32)
    _launch(_codes_decode_kernel, n, _device(packed, np.uint8), bits, bucket, levels,
            _device(scales, np.float32), out, add)
    return out
