"""GPU kernels (numba.cuda) of the quantizing codecs.

Each function here produces **the same bytes** as its CPU counterpart in
the kernel modules of the quantizing codecs (:mod:`hpccomm.kernels.onebit`,
``terngrad``, ``qsgd``, ``bitcodes``, ``halfwidth``; same counter-based
random numbers, same float32 / float64 operations in the same order), so
packets do not depend on the device:

=====================  ==============================================
``onebit_means``       the ``means`` of ``onebit.onebit_encode``
``onebit_pack``        its sign ``words``
``onebit_unpack``      ``onebit.onebit_decode``
``tern_pack``          ``terngrad.tern_pack``
``qsgd_scales``        ``qsgd.bucket_scales``
``qsgd_pack``          the codes of ``qsgd.qsgd_encode``, given scales
``codes_decode``       ``bitcodes.codes_decode``
=====================  ==============================================

and the fused kernels of the device codecs (:mod:`hpccomm.device_codecs`),
listed in the second half of this module.

(TernGrad's scale ``s`` -- a max and a standard deviation over the whole
vector -- is an input here.)  Arrays may be numpy arrays (copied to the
device) or numba device arrays; results are device arrays.  One thread per
output word, byte, element or (for the sums) bucket / column, so sums keep
the CPU's sequential lane order.

On real GPUs NVVM contracts a multiply followed by an add into a fused
multiply-add by default, which rounds once instead of twice: every float
product therefore goes through ``cuda_util.dmul_rn`` / ``fmul_rn``
(libdevice's ``mul.rn``, never fused), and the builtin two-argument
``min`` / ``max``, which the CUDA target does not type, are
``cuda_util.imin`` / ``imax``.  The bit-for-bit tests run on the simulator
(``NUMBA_ENABLE_CUDASIM=1``), which executes the kernels as Python with
plain IEEE arithmetic; ``tests/test_cuda_compile.py`` compiles every kernel
for sm_90 and checks the PTX for fused or unrounded products.

Import this module only where a GPU (or the simulator) is wanted: ``import
hpccomm`` never imports numba.cuda.
"""
import math
from functools import partial

import numpy as np
from numba import config, cuda

from . import cuda_util as U
from .cuda_util import dmul_rn, fmul_rn, imax, imin
from .quant_common import F32_MAX, LANES
from .rng import bits24_weyl, uniform01, weyl

_uniform01 = cuda.jit(device=True)(uniform01)
_weyl = cuda.jit(device=True)(weyl)
_bits24_weyl = cuda.jit(device=True)(bits24_weyl)
#: threads per block (the simulator runs each CUDA thread's code in Python)
_THREADS = 32 if config.ENABLE_CUDASIM else 128

_launch = partial(U.launch, _THREADS)


# ---------------------------------------------------------------------------
# lane sums (same order as quant_common._lane_total)
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
@cuda.jit(cache=True)
def _onebit_means_kernel(x, col_len, means):
    c = cuda.grid(1)
    if c >= means.size // 2:
        return
    n = x.size
    lo = c * col_len
    hi = imin(lo + col_len, n)
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
    means[2 * c] = _lane_total(pos) / imax(npos, 1)
    means[2 * c + 1] = _lane_total(neg) / imax(hi - lo - npos, 1)


@cuda.jit(cache=True)
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


@cuda.jit(cache=True)
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
    x = U.to_device(x, np.float32)
    means = U.empty(2 * (-(-x.size // col_len)), np.float32)
    _launch(_onebit_means_kernel, means.size // 2, x, col_len, means)
    return means


def onebit_pack(x):
    """Sign bits of ``x``: uint32 words, element ``i`` at bit ``i mod 32``."""
    x = U.to_device(x, np.float32)
    words = U.empty(-(-x.size // 32), np.uint32)
    _launch(_onebit_pack_kernel, words.size, x, words)
    return words


def onebit_unpack(words, means, col_len, n, out=None, add=False):
    """Decode sign ``words`` with per-column ``means`` into ``out`` (n float32)."""
    out = U.empty(n, np.float32) if out is None else U.to_device(out, np.float32)
    _launch(_onebit_unpack_kernel, n, U.to_device(words, np.uint32),
            U.to_device(means, np.float32), col_len, out, add)
    return out


# ---------------------------------------------------------------------------
# terngrad / qsgd: b-bit two's complement codes
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
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
            if fmul_rn(u, scale) < imin(abs(v), clip):
                byte |= (1 if v > 0 else 3) << (2 * k)
    packed[j] = byte


@cuda.jit(device=True)
def _ratio(scale, levels):
    if scale > 0 and scale < math.inf:
        return levels / np.float64(scale)
    return 0.0


@cuda.jit(cache=True)
def _qsgd_scales_kernel(x, bucket, use_max, scales):
    j = cuda.grid(1)
    if j >= scales.size:
        return
    lo = j * bucket
    hi = imin(lo + bucket, x.size)
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
        acc[(i - lo) % LANES] += dmul_rn(v, v)
    r = math.sqrt(_lane_total(acc))
    if r > F32_MAX and r < math.inf:
        r = F32_MAX
    scales[j] = r


@cuda.jit(cache=True)
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
            q = imin(int(dmul_rn(abs(np.float64(v)), ratio) + u), levels)
            if v < 0:
                q = -q
            byte |= (q & mask) << (bits * k)
    packed[j] = byte


@cuda.jit(cache=True)
def _codes_decode_kernel(packed, bits, bucket, levels, scales, out, add):
    i = cuda.grid(1)
    if i >= out.size:
        return
    half = 1 << (bits - 1)
    raw = (np.int64(packed[(i * bits) >> 3]) >> ((i * bits) & 7)) & ((1 << bits) - 1)
    q = (raw ^ half) - half
    v = np.float32(dmul_rn(np.float64(q), np.float64(scales[i // bucket]) / levels))
    if add:
        out[i] += v
    else:
        out[i] = v


def tern_pack(x, key, offset, scale, clip):
    """TernGrad codes of ``x``, 2-bit packed (``ceil(n / 4)`` bytes)."""
    x = U.to_device(x, np.float32)
    packed = U.empty(-(-x.size // 4), np.uint8)
    _launch(_tern_pack_kernel, packed.size, x, np.uint64(key), int(offset), np.float32(scale),
            np.float32(clip), packed)
    return packed


def qsgd_scales(x, bucket, use_max):
    """Per-bucket QSGD scales (float32, ``ceil(n / bucket)``)."""
    x = U.to_device(x, np.float32)
    scales = U.empty(-(-x.size // bucket), np.float32)
    _launch(_qsgd_scales_kernel, scales.size, x, bucket, bool(use_max), scales)
    return scales


def qsgd_pack(x, scales, bucket, bits, key, offset):
    """QSGD codes of ``x`` against per-bucket ``scales``, ``bits``-bit packed
    (``ceil(n bits / 8)`` bytes)."""
    x = U.to_device(x, np.float32)
    packed = U.empty(-(-(x.size * bits) // 8), np.uint8)
    _launch(_qsgd_pack_kernel, packed.size, x, U.to_device(scales, np.float32), bucket, bits,
            2 ** (bits - 1) - 1, np.uint64(key), int(offset), packed)
    return packed


def codes_decode(packed, bits, bucket, levels, scales, n, out=None, add=False):
    """Dense float32 values of packed ``bits``-bit codes (``n`` elements)."""
    out = U.empty(n, np.float32) if out is None else U.to_device(out, np.float32)
    _launch(_codes_decode_kernel, n, U.to_device(packed, np.uint8), bits, bucket, levels,
            U.to_device(scales, np.float32), out, add)
    return out


# ===========================================================================
# Fused kernels of the device codecs (hpccomm.device_codecs)
# ===========================================================================
# Element kernels are grid-stride loops over a capped grid (:func:`launch_grid`);
# statistics take one thread per column / bucket (TernGrad: one per lane),
# walking its range in index order into LANES float64 lanes, then the fixed
# lane tree: the CPU's order.  NaN/Inf counts are integers (atomic adds of
# per-thread counts: any order gives the same count).
#
# Every kernel reads its input vector through a *source*: element i is
#
#     acc = base[i] if has_base else 0.0f
#     acc += value(packet k, i) for k < npk     (up to GROUP packets, in order)
#     acc += e[i] if has_e
#
# -- the encoder's ``v = x + e`` (base = x, no packets) and the owner's ``w =
# (0 + decode(p0) + decode(p1) + ...) + e`` (packets; more than GROUP are
# summed into a base first by ``*_presum``) with the CPU's float32 order.  A
# source is the 14 arguments ``base, has_base, a0, b0, a1, b1, a2, b2, a3,
# b3, npk, flag, e, has_e``: packet k as two views ``(a_k, b_k)`` whose types
# each codec's ``value(a, b, i, n, flag)`` fixes, ``flag`` a codec switch (bf16).
# Headers of received packets are read on the device (column length, bits,
# bucket): nothing goes back to the host to decode a packet.

#: packets a source reads directly (more are pre-summed)
GROUP = 4
#: ``launch_grid(kernel, count, *args)``: ``kernel`` over ``count`` items with
#: a grid-stride loop, blocks of ``_THREADS`` (:func:`cuda_util.launch_grid`)
launch_grid = partial(U.launch_grid, _THREADS)


if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def _f32_bits(v):
        return np.float32(v).view(np.uint32)

    @cuda.jit(device=True)
    def _bits_f32(u):
        return np.uint32(u).view(np.float32)
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(v):
        return np.uint32(libdevice.float_as_int(v))

    @cuda.jit(device=True)
    def _bits_f32(u):
        return libdevice.int_as_float(np.int32(u))


def _make_source(value):
    """The source reader (see above) of a codec whose packets decode with
    ``value(a, b, i, n, flag)``."""
    @cuda.jit(device=True)
    def source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e):
        acc = base[i] if has_base else np.float32(0.0)
        if npk > 0:
            acc += value(a0, b0, i, n, flag)
        if npk > 1:
            acc += value(a1, b1, i, n, flag)
        if npk > 2:
            acc += value(a2, b2, i, n, flag)
        if npk > 3:
            acc += value(a3, b3, i, n, flag)
        if has_e:
            acc += e[i]
        return acc
    return source


def _make_presum(source):
    """``out[i] = source(i)``, element by element (in place when ``base`` is
    ``out``): the owner's rank-order sum of the packets before the last group."""
    @cuda.jit(cache=True)
    def presum(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e, out):
        n = out.size
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            out[i] = source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag,
                            e, has_e)
    return presum


def _make_decode(value):
    """``out = decode(packet)`` (mode 0), ``out += `` (1) or ``out = out -
    decode`` (2), one float32 operation per element."""
    @cuda.jit(cache=True)
    def decode(a, b, flag, out, mode):
        n = out.size
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            d = value(a, b, i, n, flag)
            if mode == 1:
                out[i] += d
            elif mode == 2:
                out[i] = out[i] - d
            else:
                out[i] = d
    return decode


@cuda.jit(device=True)
def _nonfinite(v):
    """1 for NaN or +-inf (``v - v`` is NaN exactly then), else 0."""
    return 1 if v - v != 0 else 0


# ---------------------------------------------------------------------------
# fp16 / bf16: integer rounding on bit patterns (plain functions: they also
# compile with numba.njit, which the tests compare with halfwidth's kernels)
# ---------------------------------------------------------------------------
def f16_round(w):
    """The binary16 bits of the float32 with bits ``w`` (as halfwidth's
    ``_f16_bits``): nearest even; ``|h| >= 65520`` saturates to 65504;
    inf stays; NaN becomes quiet keeping the top 9 payload bits.  Half
    subnormals round ``|v| 2**24`` to an integer, ties to even, in integers."""
    a = w & 0x7FFFFFFF
    sign = (w >> 16) & 0x8000
    if a >= 0x7F800000:
        h = 0x7C00 | ((a >> 13) & 0x3FF)
        if a > 0x7F800000:
            h |= 0x200
    elif a >= 0x477FF000:
        h = 0x7BFF
    elif a >= 0x38800000:
        h = ((a - 0x37FFF001) + ((a >> 13) & 1)) >> 13
    else:
        ex = a >> 23
        h = 0
        if ex >= 102:                       # else |v| 2**24 < 1/2: zero
            sig = (a & 0x7FFFFF) | 0x800000
            shift = 126 - ex                # 14 .. 24
            h = sig >> shift
            rem = sig & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            if rem > half or (rem == half and (h & 1) == 1):
                h += 1
    return h | sign


def bf16_round(w):
    """The bfloat16 bits of the float32 with bits ``w`` (halfwidth's
    ``_bf16_bits`` with saturation): nearest even; finite values that would
    round to inf become +-0x7F7F; NaN becomes quiet."""
    a = w & 0x7FFFFFFF
    top = w >> 16
    if a > 0x7F800000:
        return top | 0x40
    if a >= 0x7F7F8000 and a < 0x7F800000:
        return (top & 0x8000) | 0x7F7F
    return (w + 0x7FFF + (top & 1)) >> 16


def f16_value_bits(h):
    """The float32 bits of the binary16 bits ``h`` (exact; NaN canonical
    0x7FC00000 with ``h``'s sign), as halfwidth's ``_f16_value``."""
    b = np.uint32(h)
    m = b & 0x7FFF
    s = (b & 0x8000) << 16
    if m >= 0x7C00:
        r = 0x7F800000 if m == 0x7C00 else 0x7FC00000
    elif m >= 0x400:
        r = (m << 13) + 0x38000000
    elif m == 0:
        r = 0
    else:                                   # subnormal half: normalise m 2**-24
        ex = 113
        while m < 0x400:
            m = m << 1
            ex -= 1
        r = (ex << 23) | ((m & 0x3FF) << 13)
    return r | s


_f16_round = cuda.jit(device=True)(f16_round)
_bf16_round = cuda.jit(device=True)(bf16_round)
_f16_value_bits = cuda.jit(device=True)(f16_value_bits)


@cuda.jit(device=True)
def _half_bits(v, bf16):
    w = _f32_bits(v)
    return _bf16_round(w) if bf16 else _f16_round(w)


@cuda.jit(device=True)
def _half_widen(h, bf16):
    if bf16:
        return _bits_f32(np.uint32(h) << 16)
    return _bits_f32(_f16_value_bits(h))


@cuda.jit(device=True)
def _half_value(ph, unused, i, n, bf16):
    """Element ``i`` of an fp16 / bf16 packet (``ph``: the packet as uint16)."""
    return _half_widen(ph[8 + i], bf16)


_half_source = _make_source(_half_value)
half_presum = _make_presum(_half_source)
half_decode = _make_decode(_half_value)


@cuda.jit(cache=True)
def half_code(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
              n, ph, e_out, has_eout, out, has_out, bad, count):
    """fp16 / bf16 (``flag``) of the source ``v`` into ``ph`` (the packet as
    uint16), ``e_out = v - decode`` and ``out = decode`` (those flagged), the
    NaN/Inf count into ``bad[0]`` (with ``count``).  One pass."""
    cnt = 0
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        v = _half_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag,
                         e, has_e)
        if count:
            cnt += _nonfinite(v)
        h = _half_bits(v, flag)
        ph[8 + i] = h
        if has_eout or has_out:
            d = _half_widen(h, flag)
            if has_eout:
                e_out[i] = v - d
            if has_out:
                out[i] = d
    if cnt:
        cuda.atomic.add(bad, 0, cnt)


# ---------------------------------------------------------------------------
# onebit: one thread per column (statistics), signs per word
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _onebit_value(pw, pf, i, n, unused):
    """Element ``i`` of a onebit packet (``pw`` / ``pf``: the packet as
    uint32 / float32; the column length is the header's ``extra``)."""
    col = np.int64(pw[1])
    c = i // col
    ncols = (n + col - 1) // col
    word = np.int64(pw[4 + 2 * ncols + (i >> 5)])
    if (word >> (i & 31)) & 1:
        return pf[4 + 2 * c]
    return pf[5 + 2 * c]


_onebit_source = _make_source(_onebit_value)
onebit_presum = _make_presum(_onebit_source)
onebit_decode = _make_decode(_onebit_value)


@cuda.jit(device=True)
def _onebit_put(i, v, mp, mn, e_out, has_eout, out, has_out):
    """The decoded value of element ``i`` (``v`` its input) and its sign bit;
    writes ``e_out[i] = v - d`` and ``out[i] = d`` (those flagged)."""
    bit = 1 if v >= 0 else 0
    d = mp if bit else mn
    if has_eout:
        e_out[i] = v - d
    if has_out:
        out[i] = d
    return bit


@cuda.jit(cache=True)
def onebit_columns(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
                   n, col_len, ncols, pf, pw, words_here, e_out, has_eout, out, has_out,
                   bad, count):
    """Per column (one thread each): the lane sums of the source's entries
    ``>= 0`` and ``< 0`` (element ``i`` in lane ``(i - lo) mod LANES``, index
    order; onebit's ``_sign_sums``), the two means into the packet; with
    ``words_here`` (columns of whole words) also the column's sign words,
    ``e_out`` and ``out`` from a second look at the column."""
    pos = cuda.local.array(LANES, np.float64)
    neg = cuda.local.array(LANES, np.float64)
    first = 4 + 2 * ncols
    cnt = 0
    for c in range(cuda.grid(1), ncols, cuda.gridsize(1)):
        lo = c * col_len
        hi = imin(lo + col_len, n)
        for k in range(LANES):
            pos[k] = 0.0
            neg[k] = 0.0
        npos = 0
        for i in range(lo, hi):
            v32 = _onebit_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk,
                                 flag, e, has_e)
            if count:
                cnt += _nonfinite(v32)
            v = np.float64(v32)
            k = (i - lo) % LANES
            if v >= 0:
                pos[k] += v
                neg[k] += v - v
                npos += 1
            else:
                pos[k] += 0.0
                neg[k] += v
        mp = np.float32(_lane_total(pos) / imax(npos, 1))
        mn = np.float32(_lane_total(neg) / imax(hi - lo - npos, 1))
        pf[4 + 2 * c] = mp
        pf[5 + 2 * c] = mn
        if words_here:
            for w in range(lo >> 5, (hi + 31) >> 5):
                word = 0
                for k in range(imin(32, hi - 32 * w)):
                    i = 32 * w + k
                    v32 = _onebit_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3,
                                         npk, flag, e, has_e)
                    word |= _onebit_put(i, v32, mp, mn, e_out, has_eout, out, has_out) << k
                pw[first + w] = word
    if cnt:
        cuda.atomic.add(bad, 0, cnt)


@cuda.jit(cache=True)
def onebit_words(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
                 n, col_len, ncols, pf, pw, e_out, has_eout, out, has_out):
    """Sign words, ``e_out`` and ``out`` per word (one thread each), the
    means already in the packet: for columns that do not hold whole words."""
    first = 4 + 2 * ncols
    for w in range(cuda.grid(1), (n + 31) >> 5, cuda.gridsize(1)):
        word = 0
        for k in range(imin(32, n - 32 * w)):
            i = 32 * w + k
            c = i // col_len
            v32 = _onebit_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk,
                                 flag, e, has_e)
            word |= _onebit_put(i, v32, pf[4 + 2 * c], pf[5 + 2 * c], e_out, has_eout, out,
                                has_out) << k
        pw[first + w] = word


# ---------------------------------------------------------------------------
# terngrad: the moments in LANES threads, the scale on the host, then codes
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _tern_value(pu, pf, i, n, unused):
    """Element ``i`` of a TernGrad packet (``pu``: the packet as uint8,
    ``pf``: its first 20 bytes as float32, the scale at ``pf[4]``)."""
    raw = (np.int64(pu[20 + (i >> 2)]) >> (2 * (i & 3))) & 3
    q = (raw ^ 2) - 2
    return np.float32(dmul_rn(np.float64(q), np.float64(pf[4])))


_tern_source = _make_source(_tern_value)
tern_presum = _make_presum(_tern_source)
tern_decode = _make_decode(_tern_value)


@cuda.jit(cache=True)
def tern_lanes(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
               n, lanes, maxes, counts):
    """Lane ``k`` (thread ``k`` of one block of LANES): over ``i = k mod
    LANES`` in index order, ``max|v|`` (float32, NaN ignored) and the float64
    sums of ``v - v[0]``, ``(v - v[0])**2``, ``|v|`` (terngrad's
    ``_tern_moments``) into ``maxes[k]``, ``lanes[k]``, ``lanes[LANES + k]``,
    ``lanes[2 LANES + k]``; the NaN/Inf count into ``counts[k]``."""
    k = cuda.threadIdx.x
    if k >= LANES:
        return
    x0 = np.float64(_tern_source(0, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk,
                                 flag, e, has_e))
    a_max = np.float32(0.0)
    s1 = 0.0
    s2 = 0.0
    l1 = 0.0
    cnt = 0
    for i in range(k, n, LANES):
        v = _tern_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag,
                         e, has_e)
        cnt += _nonfinite(v)
        a = abs(v)
        a_max = a if a > a_max else a_max
        d = np.float64(v) - x0
        s1 += d
        s2 += dmul_rn(d, d)
        l1 += np.float64(a)
    maxes[k] = a_max
    lanes[k] = s1
    lanes[LANES + k] = s2
    lanes[2 * LANES + k] = l1
    counts[k] = cnt
    if k == 0:
        lanes[3 * LANES] = x0


@cuda.jit(cache=True)
def tern_totals(n, lanes, maxes, counts, res):
    """One thread: ``res = (max|v|, S1, S2, L1, L2, count)`` from the lanes of
    :func:`tern_lanes`, by terngrad's ``_tern_totals`` (the lane tree, ``L2 =
    S2 + x0 (2 S1 + n x0)`` with unfused products, floored at ``max|v|**2``)."""
    if cuda.grid(1) != 0:
        return
    x0 = lanes[3 * LANES]
    s1 = _lane_total(lanes[0:LANES])
    s2 = _lane_total(lanes[LANES:2 * LANES])
    l1 = _lane_total(lanes[2 * LANES:3 * LANES])
    top = maxes[0]
    cnt = counts[0]
    for k in range(1, LANES):
        top = maxes[k] if maxes[k] > top else top
        cnt += counts[k]
    l2 = s2 + dmul_rn(x0, dmul_rn(2.0, s1) + dmul_rn(np.float64(n), x0))
    floor = dmul_rn(np.float64(top), np.float64(top))
    res[0] = top
    res[1] = s1
    res[2] = s2
    res[3] = l1
    res[4] = l2 if l2 > floor else floor
    res[5] = cnt


@cuda.jit(cache=True)
def tern_code(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
              n, key, offset, scale, unit, unit_bits, pu, pw, e_out, has_eout, out, has_out):
    """Per code byte (four elements): the ternary codes of the source ``v``
    against ``scale`` (``sign(v)`` if ``u * scale < min(|v|, scale)``, in
    float32; terngrad's ``_tern_block``) packed into ``pu[20:]``, ``e_out = v
    - t unit`` and ``out = t unit`` (those flagged); the packet's scale
    ``unit`` (as bits ``unit_bits``) into ``pw[4]``."""
    start = cuda.grid(1)
    if start == 0:
        pw[4] = unit_bits
    for j in range(start, (n + 3) >> 2, cuda.gridsize(1)):
        byte = 0
        for k in range(imin(4, n - 4 * j)):
            i = 4 * j + k
            v = _tern_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag,
                             e, has_e)
            u = _uniform01(key, np.uint64(offset + i))
            t = np.float32(1.0) - fmul_rn(np.float32(2.0), np.float32(v < 0))
            if not fmul_rn(u, scale) < imin(abs(v), scale):
                t = np.float32(0.0)
            byte |= (np.int64(t) & 3) << (2 * k)
            if has_eout:
                e_out[i] = v - fmul_rn(t, unit)
            if has_out:
                out[i] = fmul_rn(t, unit)
        pu[20 + j] = byte


# ---------------------------------------------------------------------------
# qsgd: one thread per bucket (scale, contraction, and codes when buckets
# hold whole bytes), else codes per byte
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _qsgd_value(pu, pf, i, n, unused):
    """Element ``i`` of a QSGD packet (``pu``: the packet as uint8, ``pf``:
    its scales' part as float32, scale ``j`` at ``pf[4 + j]``; bits and
    bucket from the header's ``extra``)."""
    extra = np.int64(pu[4]) | (np.int64(pu[5]) << 8) | (np.int64(pu[6]) << 16) \
        | (np.int64(pu[7]) << 24)
    bits = extra >> 28
    bucket = extra & 0x0FFFFFFF
    nb = (n + bucket - 1) // bucket
    half = np.int64(1) << (bits - 1)
    pos = i * bits
    raw = (np.int64(pu[16 + 4 * nb + (pos >> 3)]) >> (pos & 7)) & ((half << 1) - 1)
    q = (raw ^ half) - half
    return np.float32(dmul_rn(np.float64(q), np.float64(pf[4 + i // bucket]) / (half - 1)))


_qsgd_source = _make_source(_qsgd_value)
qsgd_presum = _make_presum(_qsgd_source)
qsgd_decode = _make_decode(_qsgd_value)
_F64_2P24 = float(1 << 24)


@cuda.jit(device=True)
def _qsgd_put(i, v, key, offset, ratio, unit, levels, e_out, has_eout, out, has_out):
    """The QSGD code of element ``i`` (``v`` its input; qsgd's
    ``_qsgd_block``: ``floor(|v| ratio 2**24 + r) >> 24`` with unfused
    product, ``r`` the 24 random bits; zero without a draw when ``ratio ==
    0``); writes ``e_out[i] = v - float32(c unit)``, ``out[i] = float32(c
    unit)`` (those flagged)."""
    c = 0
    if ratio != 0.0:
        r = _bits24_weyl(_weyl(key, np.uint64(offset + i)))
        y = dmul_rn(abs(np.float64(v)), dmul_rn(ratio, _F64_2P24)) + np.float64(r)
        q = imin(np.int64(y) >> 24, levels)
        c = -q if v < 0 else q
    if has_eout or has_out:
        d = np.float32(dmul_rn(np.float64(c), unit))
        if has_eout:
            e_out[i] = v - d
        if has_out:
            out[i] = d
    return c


@cuda.jit(cache=True)
def qsgd_buckets(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
                 n, bucket, bits, levels, use_max, key, offset, contract, omega, omega_last,
                 pf, pu, nb, ratios, units, codes_here, e_out, has_eout, out, has_out,
                 bad, count):
    """Per bucket (one thread each), qsgd's ``_bucket_scale`` of the
    source ``v`` (lane maxima of ``|v|`` or lane sums of ``v**2``, element
    ``i`` in lane ``(i - lo) mod LANES``, index order; the l2 norm
    saturated), with ``contract`` the factor ``1 / (1 + min(omega, S
    sum|v| / (L sum v**2)))`` from the lanes of ``_bucket_norms``; the
    stored scale into ``pf[4 + j]``, ``levels / S`` and the stored scale
    over ``levels`` into ``ratios[j]`` / ``units[j]``; with ``codes_here``
    (buckets of whole bytes) the bucket's codes, ``e_out`` and ``out`` from
    a second look at the bucket."""
    acc = cuda.local.array(LANES, np.float64)
    l1s = cuda.local.array(LANES, np.float64)
    l2s = cuda.local.array(LANES, np.float64)
    per = 8 // bits
    mask = (1 << bits) - 1
    first = 16 + 4 * nb
    cnt = 0
    for j in range(cuda.grid(1), nb, cuda.gridsize(1)):
        lo = j * bucket
        hi = imin(lo + bucket, n)
        for k in range(LANES):
            acc[k] = 0.0
            l1s[k] = 0.0
            l2s[k] = 0.0
        nan = False
        for i in range(lo, hi):
            v = _qsgd_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk,
                             flag, e, has_e)
            if count:
                cnt += _nonfinite(v)
            w = np.float64(v)
            k = (i - lo) % LANES
            if use_max:
                a = abs(w)
                acc[k] = a if a > acc[k] else acc[k]
                nan = nan or a != a
            else:
                acc[k] += dmul_rn(w, w)
            if contract:
                l1s[k] += abs(w)
                l2s[k] += dmul_rn(w, w)
        if use_max:
            top = acc[0]
            for k in range(1, LANES):
                top = acc[k] if acc[k] > top else top
            scale = np.float32(math.nan) if nan else np.float32(top)
        else:
            r = math.sqrt(_lane_total(acc))
            if r > F32_MAX and r < math.inf:
                r = F32_MAX
            scale = np.float32(r)
        ratio = _ratio(scale, levels)
        stored = scale
        if contract:
            om = omega_last if j == nb - 1 else omega
            if scale > 0 and scale < math.inf:
                l1 = _lane_total(l1s)
                l2 = _lane_total(l2s)
                if l2 > 0:
                    wb = dmul_rn(np.float64(scale), l1) / dmul_rn(np.float64(levels), l2)
                    om = wb if wb < om else om
            stored = np.float32(dmul_rn(np.float64(scale), 1.0 / (1.0 + om)))
        unit = np.float64(stored) / levels
        pf[4 + j] = stored
        ratios[j] = ratio
        units[j] = unit
        if codes_here:
            for b in range((lo * bits) >> 3, (hi * bits + 7) >> 3):
                byte = 0
                for k in range(imin(per, hi - per * b)):
                    i = per * b + k
                    v = _qsgd_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3,
                                     npk, flag, e, has_e)
                    c = _qsgd_put(i, v, key, offset, ratio, unit, levels, e_out, has_eout,
                                  out, has_out)
                    byte |= (c & mask) << (bits * k)
                pu[first + b] = byte
    if cnt:
        cuda.atomic.add(bad, 0, cnt)


@cuda.jit(cache=True)
def qsgd_bytes(base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag, e, has_e,
               n, bucket, bits, levels, key, offset, pu, nb, ratios, units,
               e_out, has_eout, out, has_out):
    """Codes, ``e_out`` and ``out`` per code byte (one thread each), the
    buckets' ratios and units already known: for buckets that do not hold
    whole bytes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    first = 16 + 4 * nb
    for b in range(cuda.grid(1), (n * bits + 7) >> 3, cuda.gridsize(1)):
        byte = 0
        for k in range(imin(per, n - per * b)):
            i = per * b + k
            j = i // bucket
            v = _qsgd_source(i, n, base, has_base, a0, b0, a1, b1, a2, b2, a3, b3, npk, flag,
                             e, has_e)
            c = _qsgd_put(i, v, key, offset, ratios[j], units[j], levels, e_out, has_eout,
                          out, has_out)
            byte |= (c & mask) << (bits * k)
        pu[first + b] = byte
