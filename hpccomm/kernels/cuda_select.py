"""GPU kernels (numba.cuda) of the device twins of ``threshold``, ``adaptive``
and ``randk`` (:mod:`hpccomm.device_codecs`): the same selections, sums and
words as the CPU kernels of :mod:`hpccomm.kernels.sparsify`, bit for bit.

Layout of the work
------------------
Element passes give each thread a *segment* of :data:`SEG` consecutive
elements and walk it in index order; a selection is written by counting each
segment's entries (one pass), scanning the counts on the device
(:func:`exclusive_scan`: a thread per :data:`GROUP` counts, one thread over
the group sums, a thread per group again -- no host round trip) and walking
the segments again, each writing its entries from its start: ascending index
order whatever the launch geometry.

Reductions keep the CPU's order.  Threshold's sum of squares
(:func:`threshold_tau`): a thread per (block of :data:`BLOCK`, lane of
:data:`LANES`) sums its lane in float64 as ``sparsify._sum_squares_of`` does,
then one thread adds the lanes in order, the tail, and the blocks in order,
and forms ``tau = alpha * sqrt(ss / n)`` on the device.  Adaptive's per-column
statistics are one thread per column: its float64 sums run over the rows in
order, as on the CPU.

k-largest selections (threshold's capacity cut, adaptive's per-column and
per-sign caps and sample thresholds) are radix selections over the bit
patterns of ``|v|`` (for non-negative floats, ordered as the values; NaN is
never a candidate): four passes of 8 bits, each an integer histogram -- the
result does not depend on the order the counts are added in.  The cut keeps
every candidate above the selected value and the first ``q`` equal to it in
index order (``keep_largest``'s ties to the lower index).

Random numbers and random-k indices come from :mod:`hpccomm.kernels.rng` (the
same source compiled with ``cuda.jit(device=True)``).  Floyd's algorithm
(:func:`floyd_indices`) is sequential -- whether draw ``j`` takes ``t`` or
``j`` depends on every earlier draw -- so its draws run in one device thread;
the bitmap it fills is turned into sorted indices in parallel.

Floating point: float products go through ``cuda_util.dmul_rn`` / ``fmul_rn``
(libdevice's ``mul.rn``: NVVM / ptxas would otherwise fuse a product that
feeds an addition or subtraction into an FMA, rounding once); divisions and
``sqrt`` are IEEE (``div.rn``, ``sqrt.rn``) in numba's default (non
fast-math) mode.  Two-argument ``min`` / ``max`` are ``cuda_util.imin`` /
``imax`` (the builtins do not compile for the CUDA target);
``tests/test_cuda_compile.py`` compiles every kernel for sm_90.

Kernels do no bounds checks on what they are handed: decoders run a
validating kernel (:func:`check_sign_words`, :meth:`AdaptiveReader.check`) whose
flag the host reads before anything is scattered.

Import this module only where a GPU (or the simulator,
``NUMBA_ENABLE_CUDASIM=1``) is wanted.
"""
import math
from functools import partial

import numpy as np
from numba import config, cuda, int32

from . import cuda_util as U
from .cuda_util import dmul_rn, fmul_rn, imax, imin
from .rng import hash_index
from .sparsify import BLOCK, LANES, _scaled_index

#: threads per block
THREADS = U.THREADS
#: consecutive elements (or words, entries) per thread in the segment passes
SEG = 64
#: counts per thread in the first and last level of :func:`exclusive_scan`
GROUP = 256
#: bits of ``|v|`` below the sign bit (a float32's magnitude as an ordered key)
MAG = np.uint32(0x7FFFFFFF)
#: the key of +inf: the threshold of a side that a sample lacks
INF_KEY = 0x7F800000
F32_MAX = float(np.finfo(np.float32).max)

_hash = cuda.jit(device=True)(hash_index)
_scaled = cuda.jit(device=True)(_scaled_index.py_func)


@cuda.jit(device=True)
def _cap(h, pi, excess):
    """:func:`hpccomm.kernels.sparsify.adaptive_cap`."""
    return imin(h, excess * imax(1, (h + pi - 1) // pi))


_launch = partial(U.launch, THREADS)


def segments(n: int, per: int = SEG) -> int:
    return (n + per - 1) // per


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _set2(a, x, y):
    if cuda.grid(1) == 0:
        a[0] = x
        a[1] = y


def set2(a, x, y):
    """``a[0], a[1] = x, y`` on the device, from kernel arguments."""
    U.single(_set2, a, a.dtype.type(x), a.dtype.type(y))
    return a


def address(a) -> int:
    """The address of device array ``a``'s first element (under the simulator,
    of the host memory it wraps)."""
    if config.ENABLE_CUDASIM:   # the simulator's arrays wrap numpy arrays
        return U.mpi_buffer(a).ctypes.data
    return a.__cuda_array_interface__["data"][0]


def aligned(packet, scratch, name, align: int = 8):
    """``packet`` itself when its address is a multiple of ``align``, else a
    device copy in ``scratch(name, n, uint8)`` (packets received into one
    buffer sit at arbitrary byte offsets; the kernels read typed views)."""
    if packet.size == 0 or address(packet) % align == 0:
        return packet
    return U.copy(packet, scratch(name, packet.size, np.uint8))


# ---------------------------------------------------------------------------
# exclusive scan of int64 counts, on the device
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _scan_sums(counts, sums):
    g = cuda.grid(1)
    if g >= sums.size:
        return
    hi = imin(g * GROUP + GROUP, counts.size)
    s = 0
    for j in range(g * GROUP, hi):
        s += counts[j]
    sums[g] = s


@cuda.jit(cache=True)
def _scan_top(sums, status, slot):
    if cuda.grid(1) != 0:
        return
    run = 0
    for g in range(sums.size):
        c = sums[g]
        sums[g] = run
        run += c
    status[slot] = run


@cuda.jit(cache=True)
def _scan_apply(counts, sums, starts):
    g = cuda.grid(1)
    if g >= sums.size:
        return
    hi = imin(g * GROUP + GROUP, counts.size)
    run = sums[g]
    for j in range(g * GROUP, hi):
        c = counts[j]
        starts[j] = run
        run += c


def exclusive_scan(counts, starts, status, slot, scratch, name="scan"):
    """``starts[j] = counts[0] + ... + counts[j - 1]`` and ``status[slot] =``
    the total, all int64 on the device (``starts`` may be ``counts``).
    ``scratch(name, n, dtype)`` gives the work buffer (a kept one: the
    kernels run in stream order)."""
    groups = segments(counts.size, GROUP)
    sums = scratch(name, groups, np.int64)
    _launch(_scan_sums, groups, counts, sums)
    U.single(_scan_top, sums, status, slot)
    _launch(_scan_apply, groups, counts, sums, starts)
    return starts


# ---------------------------------------------------------------------------
# threshold: tau from the sum of squares of the fresh part
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _ss_lanes(g, parts):
    t = cuda.grid(1)
    if t >= parts.size:
        return
    b = t // LANES
    lo = b * BLOCK
    size = imin(BLOCK, g.size - lo)
    full = lo + size - size % LANES
    acc = 0.0
    for i in range(lo + t % LANES, full, LANES):
        v = np.float64(g[i])
        acc += dmul_rn(v, v)
    parts[t] = acc


@cuda.jit(cache=True)
def _ss_tau(g, parts, alpha, tau, ss):
    if cuda.grid(1) != 0:
        return
    n = g.size
    total = 0.0
    for b in range(parts.size // LANES):
        lo = b * BLOCK
        size = imin(BLOCK, n - lo)
        s = 0.0
        for lane in range(LANES):
            s += parts[b * LANES + lane]
        for i in range(lo + size - size % LANES, lo + size):
            v = np.float64(g[i])
            s += dmul_rn(v, v)
        total += s
    ss[0] = total
    t = dmul_rn(alpha, math.sqrt(total / n))
    if t <= F32_MAX:
        tau[0] = np.float32(t)
    else:
        tau[0] = np.float32(math.inf)


def threshold_tau(g, alpha, tau, scratch):
    """``tau[0] = float32(alpha * sqrt(sum(g_i^2) / n))`` (``inf`` beyond
    float32, or when the sum is NaN), the sum in
    :func:`hpccomm.kernels.sparsify.sum_squares`'s order (left in
    ``scratch("ss", 1, float64)``); ``g`` not empty.  One pass over ``g``,
    nothing back to the host."""
    parts = scratch("ss_parts", LANES * segments(g.size, BLOCK), np.float64)
    _launch(_ss_lanes, parts.size, g, parts)
    U.single(_ss_tau, g, parts, np.float64(alpha), tau, scratch("ss", 1, np.float64))
    return tau


# ---------------------------------------------------------------------------
# threshold: candidates |v| >= tau, v != 0 (0 < tau < inf), capped
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _count_select(v, vb, tau, cutq, above, equal, bad, check):
    c = cuda.grid(1)
    if c >= above.size:
        return
    t = tau[0]
    ok = t > 0 and t < math.inf
    cut = cutq[0]
    hi = imin(c * SEG + SEG, v.size)
    a = 0
    e = 0
    nf = 0
    for i in range(c * SEG, hi):
        x = v[i]
        if check and x - x != 0:
            nf += 1
        if ok and abs(x) >= t and x != 0:
            k = np.int64(vb[i] & MAG)
            if k > cut:
                a += 1
            elif k == cut:
                e += 1
    above[c] = a
    equal[c] = e
    if nf:
        cuda.atomic.add(bad, 0, nf)


@cuda.jit(cache=True)
def _radix_hist(v, vb, tau, state, shift, hist):
    counts = cuda.shared.array(256, int32)
    tid = cuda.threadIdx.x
    for b in range(tid, 256, cuda.blockDim.x):
        counts[b] = 0
    cuda.syncthreads()
    c = cuda.grid(1)
    t = tau[0]
    ok = t > 0 and t < math.inf
    high = state[0] >> (shift + 8)
    hi = imin(c * SEG + SEG, v.size)
    for i in range(c * SEG, hi):
        x = v[i]
        if ok and abs(x) >= t and x != 0:
            k = np.int64(vb[i] & MAG)
            if (k >> (shift + 8)) == high:
                cuda.atomic.add(counts, (k >> shift) & 255, 1)
    cuda.syncthreads()
    for b in range(tid, 256, cuda.blockDim.x):
        if counts[b]:
            cuda.atomic.add(hist, b, np.int64(counts[b]))


@cuda.jit(cache=True)
def _radix_pick(state, hist, shift):
    if cuda.grid(1) != 0:
        return
    k = state[1]
    b = 255
    while b > 0 and k > hist[b]:
        k -= hist[b]
        b -= 1
    state[0] = state[0] | (np.int64(b) << shift)
    state[1] = k
    for j in range(256):
        hist[j] = 0


@cuda.jit(cache=True)
def _kept(above, equal, eqb, cutq, kept):
    c = cuda.grid(1)
    if c >= kept.size:
        return
    r = imin(imax(cutq[1] - eqb[c], 0), equal[c])
    kept[c] = above[c] + r


@cuda.jit(cache=True)
def _compact_words(v, vb, tau, cutq, starts, eqb, words, resid, has_resid, out, has_out):
    c = cuda.grid(1)
    if c >= starts.size:
        return
    t = tau[0]
    nt = -t
    zero = np.float32(0)
    ok = t > 0 and t < math.inf
    cut = cutq[0]
    q = cutq[1]
    pos = starts[c]
    seen = eqb[c]
    hi = imin(c * SEG + SEG, v.size)
    for i in range(c * SEG, hi):
        x = v[i]
        keep = False
        if ok and abs(x) >= t and x != 0:
            k = np.int64(vb[i] & MAG)
            if k > cut:
                keep = True
            elif k == cut:
                keep = seen < q
                seen += 1
        if keep:
            w = np.uint64(i) << np.uint64(1)
            if x > 0:
                w |= np.uint64(1)
            words[pos] = w
            pos += 1
            d = t if x > 0 else nt
            if has_resid:
                resid[i] = resid[i] - d
            if has_out:
                out[i] = d
        elif has_out:
            out[i] = zero


class Selection:
    """Threshold's selection of ``v`` at a device ``tau``: :meth:`count` (one
    pass, the candidates' count and the NaN/Inf count to ``status[1]`` /
    ``status[0]``), then, the host knowing the count, :meth:`cap` when it
    exceeds the capacity (four histogram passes, one counting pass; nothing
    back to the host) and :meth:`write` (one pass: the words, and optionally
    the residual and the decoded vector)."""

    def __init__(self, v, tau, status, scratch):
        self.v, self.vb, self.tau, self.status = v, v.view(np.uint32), tau, status
        self.scratch = scratch
        self.segs = segments(v.size)
        self.cutq = set2(scratch("cutq", 2, np.int64), -1, 0)
        self.starts = self.eqb = None

    def count(self, check: bool):
        above = self.scratch("above", self.segs, np.int64)
        equal = self.scratch("equal", self.segs, np.int64)
        _launch(_count_select, self.segs, self.v, self.vb, self.tau, self.cutq, above, equal,
                self.status, bool(check))
        self.starts = exclusive_scan(above, above, self.status, 1, self.scratch)
        self.eqb = self.starts

    def cap(self, k: int):
        """Keep the ``k`` largest ``|v|`` of the candidates, ties to lower indices."""
        cutq = set2(self.cutq, 0, k)
        hist = U.fill(self.scratch("hist", 256, np.int64), 0)
        for shift in (24, 16, 8, 0):
            _launch(_radix_hist, self.segs, self.v, self.vb, self.tau, cutq, shift, hist)
            U.single(_radix_pick, cutq, hist, shift)
        above = self.scratch("above", self.segs, np.int64)
        equal = self.scratch("equal", self.segs, np.int64)
        _launch(_count_select, self.segs, self.v, self.vb, self.tau, cutq, above, equal,
                self.status, False)
        eqb = exclusive_scan(equal, self.scratch("eqb", self.segs, np.int64), self.status, 2,
                             self.scratch)
        kept = self.scratch("kept", self.segs, np.int64)
        _launch(_kept, self.segs, above, equal, eqb, cutq, kept)
        self.starts = exclusive_scan(kept, kept, self.status, 1, self.scratch)
        self.eqb = eqb

    def write(self, words, resid=None, out=None):
        dummy = self.v
        _launch(_compact_words, self.segs, self.v, self.vb, self.tau, self.cutq, self.starts,
                self.eqb, words, dummy if resid is None else resid, resid is not None,
                dummy if out is None else out, out is not None)


@cuda.jit(cache=True)
def _tau_fields(fields, tau, m):
    if cuda.grid(1) == 0:
        fields[0] = tau[0] if m > 0 else np.float32(0)
        fields[1] = np.float32(0)


def write_tau(fields, tau, m):
    """The packet's tau (``tau[0]``, 0 when ``m = 0``) and zero padding:
    ``fields`` = float32 view of bytes 16..24."""
    U.single(_tau_fields, fields, tau, int(m))


# ---------------------------------------------------------------------------
# threshold: decoding Strom words
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _check_words(words, n, fields, pad, flags, slot):
    c = cuda.grid(1)
    if c == 0:
        t = fields[0]
        if not (t == t and t < math.inf and t >= 0) or pad[1] != 0:
            flags[slot] = 1
    lo = c * SEG
    if lo >= words.size:
        return
    hi = imin(lo + SEG, words.size)
    prev = np.int64(-1)
    if c > 0:
        prev = np.int64(np.uint64(words[lo - 1]) >> np.uint64(1))
    for j in range(lo, hi):
        i = np.int64(np.uint64(words[j]) >> np.uint64(1))
        if i <= prev or i >= n:
            flags[slot + 1] = 1
            return
        prev = i


def check_sign_words(words, n, fields, flags, slot):
    """``flags[slot] = 1`` for a non-finite or negative tau or non-zero
    padding, ``flags[slot + 1] = 1`` for word indices that are not strictly
    increasing inside ``[0, n)`` (``flags`` zeroed by the caller)."""
    _launch(_check_words, max(1, segments(words.size)), words, n, fields,
            fields.view(np.uint32), flags, slot)


@cuda.jit(cache=True)
def _scatter_words(words, fields, out, mode):
    c = cuda.grid(1)
    hi = imin(c * SEG + SEG, words.size)
    t = fields[0]
    nt = -t
    for j in range(c * SEG, hi):
        w = np.uint64(words[j])
        i = np.int64(w >> np.uint64(1))
        d = t if (w & np.uint64(1)) else nt
        if mode == 0:
            out[i] = d
        elif mode == 1:
            out[i] += d
        else:
            out[i] = out[i] - d


def scatter_sign_words(words, fields, out, mode):
    """``out[w >> 1]`` set to (``mode`` 0), plus (1) or minus (2) ``+-tau``
    (``fields[0]``) at validated words."""
    _launch(_scatter_words, segments(words.size), words, fields, out, mode)


# ---------------------------------------------------------------------------
# randk: Floyd's k-subset, values at the indices
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _floyd(key, n, k, bitmap):
    if cuda.grid(1) != 0:
        return
    one = np.uint64(1)
    for j in range(n - k, n):
        t = np.int64(_hash(key, np.uint64(j)) % np.uint64(j + 1))
        if (bitmap[t >> 6] >> np.uint64(t & 63)) & one:
            t = j
        bitmap[t >> 6] |= one << np.uint64(t & 63)


@cuda.jit(cache=True)
def _bit_counts(bitmap, counts):
    c = cuda.grid(1)
    if c >= counts.size:
        return
    hi = imin(c * SEG + SEG, bitmap.size)
    s = 0
    for w in range(c * SEG, hi):
        s += cuda.popc(bitmap[w])
    counts[c] = s


@cuda.jit(cache=True)
def _bit_indices(bitmap, starts, idx):
    c = cuda.grid(1)
    if c >= starts.size:
        return
    one = np.uint64(1)
    pos = starts[c]
    hi = imin(c * SEG + SEG, bitmap.size)
    for w in range(c * SEG, hi):
        bits = bitmap[w]
        for b in range(64):
            if (bits >> np.uint64(b)) & one:
                idx[pos] = w * 64 + b
                pos += 1


def floyd_indices(key, n, idx, scratch):
    """``idx`` (``k`` = its size) = :func:`hpccomm.kernels.sparsify.floyd_indices`
    of ``key``: the draws in one device thread (each depends on the set the
    earlier ones built), the bitmap into sorted indices in parallel."""
    k = idx.size
    if k == 0:
        return idx
    words = (n + 63) // 64
    bitmap = U.fill(scratch("bitmap", words, np.uint64), 0)
    U.single(_floyd, np.uint64(key), np.int64(n), np.int64(k), bitmap)
    segs = segments(words)
    counts = scratch("bitcounts", segs, np.int64)
    _launch(_bit_counts, segs, bitmap, counts)
    status = scratch("bitstatus", 1, np.int64)
    exclusive_scan(counts, counts, status, 0, scratch)
    _launch(_bit_indices, segs, bitmap, counts, idx)
    return idx


@cuda.jit(cache=True)
def _gather(v, idx, scale, scaled, vals, resid, has_resid):
    c = cuda.grid(1)
    hi = imin(c * SEG + SEG, idx.size)
    for j in range(c * SEG, hi):
        i = idx[j]
        x = v[i]
        if scaled:
            x = fmul_rn(x, scale)
        vals[j] = x
        if has_resid:
            resid[i] = resid[i] - x


def gather(v, idx, vals, scale=None, resid=None):
    """``vals = v[idx]`` (times the float32 ``scale`` when given);
    ``resid[idx] -= vals`` when ``resid`` is given (``resid`` holding ``v``:
    ``v - decode``)."""
    _launch(_gather, segments(idx.size), v, idx, np.float32(scale or 0),
            scale is not None, vals, v if resid is None else resid, resid is not None)


@cuda.jit(cache=True)
def _scatter_vals(idx, vals, out, mode):
    c = cuda.grid(1)
    hi = imin(c * SEG + SEG, idx.size)
    for j in range(c * SEG, hi):
        i = idx[j]
        if mode == 0:
            out[i] = vals[j]
        elif mode == 1:
            out[i] += vals[j]
        else:
            out[i] = out[i] - vals[j]


def scatter_values(idx, vals, out, mode):
    """``out[idx]`` set to (``mode`` 0), plus (1) or minus (2) ``vals``."""
    _launch(_scatter_vals, segments(idx.size), idx, vals, out, mode)


@cuda.jit(cache=True)
def _read_u64(packet, at, dst, slot):
    if cuda.grid(1) == 0:
        k = np.uint64(0)
        for b in range(8):
            k |= np.uint64(packet[at + b]) << np.uint64(8 * b)
        dst[slot] = k


def read_u64(packet, at, dst, slot):
    """``dst[slot]`` = the little-endian uint64 at byte ``at`` of ``packet``."""
    U.single(_read_u64, packet, at, dst, slot)


# ---------------------------------------------------------------------------
# adaptive: per-column statistics, one thread per column
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _sample_row(key, base, lo, j, h, sampled):
    if sampled:
        return lo + _scaled(_hash(key, base + np.uint64(lo + j)), h)
    return lo + j


@cuda.jit(device=True)
def _pick(hist, k, prefix, shift):
    """Bin of the k-th largest (from the top) of ``hist``: returns the new
    prefix and the rank left inside the bin."""
    b = 255
    while b > 0 and k > hist[b]:
        k -= hist[b]
        b -= 1
    return prefix | (np.int64(b) << shift), k


@cuda.jit(cache=True)
def _adaptive_stats(v, vb, H, pi, samples, excess, key, base, counts, mus, cuts, bad,
                    check):
    c = cuda.grid(1)
    if c >= counts.size:
        return
    n = v.size
    lo = c * H
    hi = imin(lo + H, n)
    h = hi - lo
    hp = cuda.local.array(256, int32)
    hn = cuda.local.array(256, int32)
    sampled = h > samples
    S = samples if sampled else h
    # 1. thresholds from the sample: the max(1, s // pi)-th largest per sign
    cps = 0
    cns = 0
    for j in range(S):
        x = v[_sample_row(key, base, lo, j, h, sampled)]
        if x > 0:
            cps += 1
        elif x < 0:
            cns += 1
    kp = imax(1, cps // pi)
    kn = imax(1, cns // pi)
    tp = np.int64(INF_KEY)
    tn = np.int64(INF_KEY)
    if cps or cns:
        pp = np.int64(0)
        pn = np.int64(0)
        for d in range(4):
            shift = 24 - 8 * d
            for b in range(256):
                hp[b] = 0
                hn[b] = 0
            for j in range(S):
                r = _sample_row(key, base, lo, j, h, sampled)
                x = v[r]
                k = np.int64(vb[r] & MAG)
                if x > 0:
                    if (k >> (shift + 8)) == (pp >> (shift + 8)):
                        hp[(k >> shift) & 255] += 1
                elif x < 0:
                    if (k >> (shift + 8)) == (pn >> (shift + 8)):
                        hn[(k >> shift) & 255] += 1
            pp, kp = _pick(hp, kp, pp, shift)
            pn, kn = _pick(hn, kn, pn, shift)
        if cps:
            tp = pp
        if cns:
            tn = pn
    # 2. the selection {v >= tau_pos}, {v <= -tau_neg}: counts, row-order sums
    cp = 0
    cn = 0
    sp = 0.0
    sn = 0.0
    nf = 0
    for i in range(lo, hi):
        x = v[i]
        if check and x - x != 0:
            nf += 1
        k = np.int64(vb[i] & MAG)
        if x > 0 and k >= tp:
            cp += 1
            sp += np.float64(x)
        elif x < 0 and k >= tn:
            cn += 1
            sn += np.float64(x)
    if nf:
        cuda.atomic.add(bad, 0, nf)
    # 3. a side over its cap keeps its cap largest, ties to lower rows
    cap = _cap(h, pi, excess)
    cut_p = np.int64(-1)
    cut_n = np.int64(-1)
    qp = np.int64(0)
    qn = np.int64(0)
    trim_p = cp > cap
    trim_n = cn > cap
    if trim_p or trim_n:
        pp = np.int64(0)
        pn = np.int64(0)
        kp = np.int64(cap)
        kn = np.int64(cap)
        for d in range(4):
            shift = 24 - 8 * d
            for b in range(256):
                hp[b] = 0
                hn[b] = 0
            for i in range(lo, hi):
                x = v[i]
                k = np.int64(vb[i] & MAG)
                if trim_p and x > 0 and k >= tp:
                    if (k >> (shift + 8)) == (pp >> (shift + 8)):
                        hp[(k >> shift) & 255] += 1
                elif trim_n and x < 0 and k >= tn:
                    if (k >> (shift + 8)) == (pn >> (shift + 8)):
                        hn[(k >> shift) & 255] += 1
            pp, kp = _pick(hp, kp, pp, shift)
            pn, kn = _pick(hn, kn, pn, shift)
        seen_p = 0
        seen_n = 0
        tot_p = 0.0
        tot_n = 0.0
        for i in range(lo, hi):
            x = v[i]
            k = np.int64(vb[i] & MAG)
            if trim_p and x > 0 and k >= tp:
                if k > pp or (k == pp and seen_p < kp):
                    tot_p += np.float64(x)
                    if k == pp:
                        seen_p += 1
            elif trim_n and x < 0 and k >= tn:
                if k > pn or (k == pn and seen_n < kn):
                    tot_n += np.float64(x)
                    if k == pn:
                        seen_n += 1
        if trim_p:
            cut_p = pp
            qp = kp
            cp = cap
            sp = tot_p
        if trim_n:
            cut_n = pn
            qn = kn
            cn = cap
            sn = tot_n
    counts[c] = cp + cn
    mus[2 * c] = np.float32(sp / cp) if cp else np.float32(0)
    mus[2 * c + 1] = np.float32(sn / cn) if cn else np.float32(0)
    cuts[6 * c] = tp
    cuts[6 * c + 1] = cut_p
    cuts[6 * c + 2] = qp
    cuts[6 * c + 3] = tn
    cuts[6 * c + 4] = cut_n
    cuts[6 * c + 5] = qn


def adaptive_stats(v, H, pi, samples, excess, key, offset, bad, check, scratch):
    """Per column: the entry count (int64), the means ``(mu_pos, mu_neg)``
    (float32 pairs) and the cuts the write pass applies; ``bad[0] +=`` the
    NaN/Inf count with ``check``.  One thread per column."""
    W = segments(v.size, H)
    counts = scratch("counts", W, np.int64)
    mus = scratch("mus", 2 * W, np.float32)
    cuts = scratch("cuts", 6 * W, np.int64)
    _launch(_adaptive_stats, W, v, v.view(np.uint32), np.int64(H), np.int64(pi),
            np.int64(samples), np.int64(excess), np.uint64(key), np.uint64(offset), counts,
            mus, cuts, bad, bool(check))
    return counts, mus, cuts


@cuda.jit(cache=True)
def _adaptive_write(v, vb, H, counts, mus, cuts, starts, recs, recs_f, words, resid,
                    has_resid, out, has_out):
    c = cuda.grid(1)
    if c >= counts.size:
        return
    lo = c * H
    hi = imin(lo + H, v.size)
    zero = np.float32(0)
    recs[3 * c] = counts[c]
    recs_f[3 * c + 1] = mus[2 * c]
    recs_f[3 * c + 2] = mus[2 * c + 1]
    dp = zero + mus[2 * c]
    dn = zero + mus[2 * c + 1]
    tp = cuts[6 * c]
    cut_p = cuts[6 * c + 1]
    qp = cuts[6 * c + 2]
    tn = cuts[6 * c + 3]
    cut_n = cuts[6 * c + 4]
    qn = cuts[6 * c + 5]
    seen_p = 0
    seen_n = 0
    pos = starts[c]
    for i in range(lo, hi):
        x = v[i]
        k = np.int64(vb[i] & MAG)
        keep = False
        positive = x > 0
        if positive and k >= tp:
            if k > cut_p:
                keep = True
            elif k == cut_p:
                keep = seen_p < qp
                seen_p += 1
        elif x < 0 and k >= tn:
            if k > cut_n:
                keep = True
            elif k == cut_n:
                keep = seen_n < qn
                seen_n += 1
        if keep:
            row = np.uint32(i - lo) << np.uint32(1)
            if positive:
                row |= np.uint32(1)
            words[pos] = row
            pos += 1
            d = dp if positive else dn
            if has_resid:
                resid[i] = resid[i] - d
            if has_out:
                out[i] = d
        elif has_out:
            out[i] = zero


def adaptive_write(v, H, counts, mus, cuts, starts, body, resid=None, out=None):
    """The packet body after ``H``: ``body`` (uint8 from byte 20) gets the column
    records and the words; ``resid[i] -= 0 + mu`` at the sent rows (``resid``
    holding ``v``) and ``out = decode`` when given.  One thread per column."""
    W = counts.size
    recs = body[:12 * W].view(np.uint32)
    words = body[12 * W:].view(np.uint32)
    _launch(_adaptive_write, W, v, v.view(np.uint32), np.int64(H), counts, mus, cuts, starts,
            recs, recs.view(np.float32), words, v if resid is None else resid,
            resid is not None, v if out is None else out, out is not None)


# ---------------------------------------------------------------------------
# adaptive: decoding (H and the column count W come from the packet)
# ---------------------------------------------------------------------------
@cuda.jit(device=True)
def _columns(head, n):
    H = np.int64(head[0])
    if H < 1 or H > n:
        return H, np.int64(0)
    return H, (n + H - 1) // H


@cuda.jit(cache=True)
def _adaptive_counts(head, body, n, counts):
    c = cuda.grid(1)
    if c >= counts.size:
        return
    H, W = _columns(head, n)
    counts[c] = np.int64(body[3 * c]) if c < W else 0


@cuda.jit(cache=True)
def _adaptive_check(head, body, n, pi, excess, counts, starts, status, flags, slot):
    c = cuda.grid(1)
    if c >= imax(counts.size, 1):
        return
    H, W = _columns(head, n)
    m = body.size - 3 * W
    if c == 0:
        flags[slot + 1] = H
        if W == 0 or m < 0 or status[0] != m:
            flags[slot] = 1
    if c >= W or m < 0:
        return
    lo = c * H
    h = imin(H, n - lo)
    cap = _cap(h, pi, excess)
    cnt = counts[c]
    first = starts[c]
    if first + cnt > m:
        flags[slot] = 1
        return
    prev = np.int64(-1)
    npos = 0
    for j in range(first, first + cnt):
        w = np.int64(body[3 * W + j])
        r = w >> 1
        if r <= prev or r >= h:
            flags[slot] = 1
            return
        prev = r
        npos += w & 1
    if npos > cap or cnt - npos > cap:
        flags[slot] = 1


class AdaptiveReader:
    """A received adaptive packet (aligned, ``n > 0``): :meth:`check` launches
    its validation (``flags[slot] = 1`` when invalid, ``flags[slot + 1] = H``),
    :meth:`scatter` decodes it once the host has read the flags."""

    def __init__(self, packet, n, scratch, name):
        self.n, self.scratch, self.name = n, scratch, name
        self.head = packet[16:20].view(np.uint32)
        self.body = packet[20:20 + (packet.size - 20) // 4 * 4].view(np.uint32)
        # every column takes 12 bytes: at most this many (threads past the
        # packet's W do nothing)
        self.wmax = max(1, min(n, self.body.size // 3))
        self.counts = scratch(name + "counts", self.wmax, np.int64)
        self.starts = scratch(name + "starts", self.wmax, np.int64)
        self.status = scratch(name + "status", 1, np.int64)

    def check(self, pi, excess, flags, slot):
        _launch(_adaptive_counts, self.wmax, self.head, self.body, np.int64(self.n),
                self.counts)
        exclusive_scan(self.counts, self.starts, self.status, 0, self.scratch, self.name + "scan")
        _launch(_adaptive_check, self.wmax, self.head, self.body, np.int64(self.n),
                np.int64(pi), np.int64(excess), self.counts, self.starts, self.status, flags,
                slot)

    def scatter(self, H, out, mode):
        W = segments(self.n, H)
        _launch(_adaptive_scatter, W, self.body, self.body.view(np.float32), np.int64(H),
                np.int64(W), self.starts, self.counts, out, mode)


@cuda.jit(cache=True)
def _adaptive_scatter(body, body_f, H, W, starts, counts, out, mode):
    c = cuda.grid(1)
    if c >= W:
        return
    lo = c * H
    zero = np.float32(0)
    mp = body_f[3 * c + 1]
    mn = body_f[3 * c + 2]
    first = starts[c]
    for j in range(first, first + counts[c]):
        w = np.int64(body[3 * W + j])
        i = lo + (w >> 1)
        d = mp if w & 1 else mn
        if mode == 2:
            out[i] = out[i] - (zero + d)
        else:
            out[i] += d
