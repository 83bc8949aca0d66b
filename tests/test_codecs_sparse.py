"""Sparsifying codecs (threshold, adaptive, topk, randk, dgc) and the DGC
momentum helper, against plain numpy reference implementations.  No MPI."""
import math
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hpccomm
from hpccomm.codecs import HEADER_SIZE, EncodeContext, get_codec
from hpccomm.codecs.base import VECTOR_COLUMN
from hpccomm.codecs import dgc as dgc_mod
from hpccomm.codecs import topk as topk_mod
from hpccomm.dgc_optimizer import DGCMomentum, warmup_density
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels.rng import hash_index_cpu, stream_key
from hpccomm.kernels import sparsify as sparse_kernels
from hpccomm.kernels.sparsify import BLOCK

SIZES = [0, 1, 7, 31, 33, 100, 1000, 4097]
CTX = EncodeContext(seed=5, rank=1, step=3)

#: one instance per codec, with parameters that make every size interesting
CASES = {
    "topk": dict(ratio=0.05),
    "topk_exact": dict(ratio=0.05, exact=True),
    "dgc": dict(ratio=0.05),
    "threshold_tau": dict(tau=1.0),
    "threshold_alpha": dict(alpha=1.5),
    "randk": dict(ratio=0.1),
    "randk_biased": dict(ratio=0.1, unbiased=False),
    "adaptive": dict(proportion=4),
    "adaptive_cols": dict(proportion=2, col_len=10),
}


def codec_of(case):
    return get_codec(case.split("_")[0], **CASES[case])


def data(n, seed=0):
    return np.random.default_rng([n, seed]).standard_normal(n).astype(np.float32)


def roundtrip(codec, x, ctx=CTX):
    packet = codec.encode(x, ctx)
    out = np.full(x.size, np.nan, dtype=np.float32)
    codec.decode(packet, out)
    return packet, out


def count_for(ratio, n):
    """k = max(1, ceil(ratio n)) on the decimal value of ratio; 0 for n = 0."""
    return 0 if n == 0 else min(n, max(1, math.ceil(Fraction(repr(ratio)) * n)))


# ---------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------
def ref_largest(x, cand, k):
    """The k candidates (sorted index array) of largest |x|, ties to lower
    indices, sorted by index."""
    if cand.size <= k:
        return cand
    order = np.lexsort((cand, -np.abs(x[cand].astype(np.float64))))
    return np.sort(cand[order[:k]])


def ref_topk(x, k):
    return ref_largest(x, np.flatnonzero(x), k)


def dense(n, idx, vals):
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


def ref_threshold(x, tau, cap):
    tau = np.float32(tau)
    idx = ref_largest(x, np.flatnonzero(np.abs(x) >= tau), cap)
    return dense(x.size, idx, np.where(x[idx] > 0, tau, -tau))


def ref_dgc(x, ratio, sample_ratio, max_iters, ctx):
    n = x.size
    k = count_for(ratio, n)
    if k == 0:
        return np.zeros(0, np.float32)
    s = min(n, max(math.ceil(sample_ratio * n), math.ceil(2 / ratio)))
    stride = n // s
    key = stream_key(ctx.seed, ctx.rank, ctx.step, dgc_mod.SALT)
    start = int(hash_index_cpu(key, np.uint64(ctx.offset)) % np.uint64(stride))
    sample = np.abs(x[start::stride][:s])
    thr = np.sort(sample)[::-1][min(s, max(1, math.ceil(s * ratio))) - 1]
    count = lambda t: int(np.count_nonzero((np.abs(x) >= t) & (x != 0)))  # noqa: E731
    c = count(thr)
    for _ in range(max_iters):
        if c >= 0.8 * k or thr == 0:
            break
        thr = np.float32(thr * np.float32(0.8))
        c = count(thr)
    idx = ref_largest(x, np.flatnonzero((np.abs(x) >= thr) & (x != 0)), k)
    return dense(n, idx, x[idx])


def ref_adaptive(x, H, pi, excess, samples=None, ctx=CTX):
    """Adaptive quantization as documented in the codec: columns of more than
    ``samples`` rows take their thresholds from ``samples`` rows drawn with
    the counter RNG, shorter ones from all their rows; means are row-order
    float64 sums (``cumsum``) over the counts."""
    from hpccomm.codecs.adaptive import SALT
    from hpccomm.kernels.rng import hash_index
    key = stream_key(ctx.seed, ctx.rank, ctx.step, SALT)
    out = np.zeros(x.size, dtype=np.float32)
    for lo in range(0, x.size, max(1, H)):
        col = x[lo:lo + H]
        h = col.size
        sample = col
        if samples is not None and h > samples:
            z = hash_index(key, np.arange(samples, dtype=np.uint64) + np.uint64(ctx.offset + lo))
            m32, s32, hh = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(h)
            rows = ((z >> s32) * hh + (((z & m32) * hh) >> s32)) >> s32
            sample = col[rows.astype(np.int64)]
        cap = min(h, excess * max(1, -(-h // pi)))
        for sign in (1, -1):
            v = (col * np.float32(sign)).astype(np.float32)
            drawn = (sample * np.float32(sign)).astype(np.float32)
            top = np.sort(drawn[drawn > 0])[::-1]
            if top.size == 0:
                continue
            tau = top[max(1, top.size // pi) - 1]
            rows = ref_largest(v, np.flatnonzero(v >= tau), cap)
            if rows.size:
                total = np.cumsum(col[rows].astype(np.float64))[-1]
                out[lo + rows] = np.float32(total / rows.size)
    return out


# ---------------------------------------------------------------------------
# registry, parameters, sizes
# ---------------------------------------------------------------------------
def test_registered_ids_and_flags():
    ids = {name: get_codec(name, **({"tau": 1.0} if name == "threshold" else {})).codec_id
           for name in ("threshold", "adaptive", "topk", "randk", "dgc")}
    assert ids == {"threshold": 6, "adaptive": 7, "topk": 8, "randk": 9, "dgc": 10}
    for case in CASES:
        c = codec_of(case)
        assert c.fixed_size == (c.name == "randk")
        assert c.biased == (case != "randk")
        assert c.summable == (case in ("threshold_tau", "randk", "randk_biased"))
        assert c.stochastic == (c.name != "threshold")
        assert c.name in c.describe()


@pytest.mark.parametrize("name,params", [
    ("threshold", {"tau": 1.0, "alpha": 1.0}), ("threshold", {"tau": -1}),
    ("threshold", {"alpha": float("nan")}), ("threshold", {"tau": 1e-50}), ("threshold", {"tau": 1e39}),
    ("threshold", {"tau": 1.0, "max_ratio": 0}), ("topk", {"ratio": 0}),
    ("topk", {"ratio": 1.5}), ("dgc", {"sample_ratio": 2}), ("dgc", {"max_iters": -1}),
    ("randk", {"ratio": -0.1}), ("adaptive", {"proportion": 0}),
    ("adaptive", {"proportion": 8, "samples": 63}), ("adaptive", {"col_len": 2 ** 31}),
    ("adaptive", {"excess": 1.5}),
])
def test_bad_parameters(name, params):
    with pytest.raises(ValueError):
        get_codec(name, **params)


def test_threshold_defaults_to_alpha():
    """``alpha = 1 / max_ratio``: the steady-state density under error
    feedback, ``mean|g| / tau <= 1 / alpha``, then stays within the cap."""
    c = get_codec("threshold")
    assert c.tau is None and c.alpha == 4.0 and not c.summable
    assert get_codec("threshold", max_ratio=0.1).alpha == 10.0


def test_counts_use_the_decimal_ratio():
    c = get_codec("topk", ratio=0.07)
    assert c.max_count(100) == 7 and c.max_count(0) == 0 and c.max_count(1) == 1
    assert get_codec("randk", ratio=0.07).count(100) == 7


def test_wide_vectors_use_64_bit_indices():
    n = 2 ** 31
    k = count_for(0.01, n)
    assert get_codec("topk").max_wire_size(n) == HEADER_SIZE + 12 * k
    assert get_codec("topk").max_wire_size(n - 1) == HEADER_SIZE + 8 * count_for(0.01, n - 1)
    t = get_codec("threshold", tau=1.0, max_ratio=0.5)
    assert t.max_wire_size(n) == 24 + 8 * (n // 2)
    assert get_codec("randk").wire_size(n) == 24 + 4 * k


def wire_size(codec, packet, n, x, ctx):
    """The documented size formula, from the packet's own count."""
    m = int(packet[4:8].view(np.uint32)[0])
    name = codec.name
    if name in ("topk", "dgc"):
        return HEADER_SIZE + 8 * m
    if name == "threshold":
        return 24 + 4 * m
    if name == "randk":
        return 24 + 4 * codec.count(n)
    H = codec.column_length(n, ctx.shape)
    return 20 + 12 * (-(-n // H) if n else 0) + 4 * m


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", SIZES)
def test_wire_size_bound_and_sparsify(case, n):
    codec = codec_of(case)
    x = data(n)
    ctx = EncodeContext(seed=5, rank=1, step=3, shape=(n // 10, 10) if n % 10 == 0 and n else ())
    packet, out = roundtrip(codec, x, ctx)
    assert packet.dtype == np.uint8 and packet.size == wire_size(codec, packet, n, x, ctx)
    assert packet.size <= codec.max_wire_size(n)
    if codec.fixed_size:
        assert packet.size == codec.wire_size(n)
    else:
        assert codec.wire_size(n) is None
    idx, vals = codec.sparsify(x, ctx)
    assert idx.dtype == np.int32 and vals.dtype == np.float32
    assert np.all(np.diff(idx) > 0)
    np.testing.assert_array_equal(dense(n, idx, vals), out)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_add_is_previous_plus_decode(case):
    codec = codec_of(case)
    x = data(1000, 1)
    packet, decoded = roundtrip(codec, x)
    prev = data(1000, 2)
    acc = prev.copy()
    codec.decode_add(packet, acc)
    np.testing.assert_array_equal(acc, prev + decoded)
    # decode overwrites everything, zeros where nothing was sent
    out = data(1000, 3)
    codec.decode(packet, out)
    np.testing.assert_array_equal(out, decoded)


@pytest.mark.parametrize("case", list(CASES))
def test_unaligned_packets_decode(case):
    codec = codec_of(case)
    x = data(1000, 4)
    packet, decoded = roundtrip(codec, x)
    buf = np.zeros(packet.size + 1, dtype=np.uint8)
    buf[1:] = packet
    out = np.empty(1000, dtype=np.float32)
    codec.decode(buf[1:], out)
    np.testing.assert_array_equal(out, decoded)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4097, BLOCK - 1, BLOCK, BLOCK + 1,
                               3 * BLOCK + 5])
@pytest.mark.parametrize("t", [0.0, 0.5, 2.0, 1e9])
def test_threshold_selection_matches_numpy(n, t):
    """``select_abs_ge`` and ``count_abs_ge`` against numpy on both sides of
    one block (up to a block they run the blocks' serial kernels directly,
    above it the parallel ones): zeros of both signs never selected, indices
    in either width."""
    x = data(n, 7)
    x[::7] = 0.0
    if n > 3:
        x[1], x[2] = -0.0, 2.0
    want = np.flatnonzero((np.abs(x) >= np.float32(t)) & (x != 0))
    for width in (np.int32, np.int64):
        idx, vals = sparse_kernels.select_abs_ge(x, t, width)
        assert idx.dtype == width and vals.dtype == np.float32
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(vals.view(np.uint32), x[want].view(np.uint32))
    assert sparse_kernels.count_abs_ge(x, t) == want.size


# ---------------------------------------------------------------------------
# topk
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("exact", [False, True])
def test_topk_matches_numpy(n, exact):
    x = data(n)
    codec = get_codec("topk", ratio=0.05, exact=exact)
    packet, out = roundtrip(codec, x)
    k = count_for(0.05, n)
    idx = ref_topk(x, k)
    np.testing.assert_array_equal(out, dense(n, idx, x[idx]))
    assert int(packet[4:8].view(np.uint32)[0]) == min(k, np.count_nonzero(x))


def test_topk_ties_go_to_lower_indices():
    x = np.array([1, -3, 3, 0, 3, -3, 2], dtype=np.float32)
    out = get_codec("topk", ratio=0.4).roundtrip(x)  # k = 3
    np.testing.assert_array_equal(out, [0, -3, 3, 0, 3, 0, 0])


def test_topk_sampled_threshold_on_long_vectors():
    n = 200_000
    x = data(n, 7)
    codec = get_codec("topk", ratio=0.01)
    assert codec.sample_size(n) < n
    k = count_for(0.01, n)
    idx = ref_topk(x, k)
    np.testing.assert_array_equal(codec.roundtrip(x, CTX), dense(n, idx, x[idx]))


def test_topk_exact_recovers_when_the_sample_overshoots():
    """Put large values exactly where the strided sample looks: the sampled
    threshold then passes fewer than k elements."""
    n, ratio = 100_000, 0.2
    codec = get_codec("topk", ratio=ratio)
    s = codec.sample_size(n)
    stride = n // s
    key = stream_key(CTX.seed, CTX.rank, CTX.step, topk_mod.SALT)
    start = int(hash_index_cpu(key, np.uint64(CTX.offset)) % np.uint64(stride))
    x = np.full(n, 5, dtype=np.float32)
    x[start:start + stride * (s - 1) + 1:stride] = 10
    k = count_for(ratio, n)
    assert s < k
    loose = codec.roundtrip(x, CTX)
    assert np.count_nonzero(loose) == s and np.all(loose[loose != 0] == 10)
    exact = get_codec("topk", ratio=ratio, exact=True).roundtrip(x, CTX)
    idx = ref_topk(x, k)
    np.testing.assert_array_equal(exact, dense(n, idx, x[idx]))


def test_topk_ratio_one_sends_every_nonzero():
    x = data(5000, 8)
    x[::3] = 0
    np.testing.assert_array_equal(get_codec("topk", ratio=1.0).roundtrip(x), x)


# ---------------------------------------------------------------------------
# dgc
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES + [100_000])
def test_dgc_matches_numpy(n):
    x = data(n, 9)
    codec = get_codec("dgc", ratio=0.01)
    ctx = EncodeContext(seed=2, rank=0, step=11, offset=123)
    packet = codec.encode(x, ctx)
    out = np.empty(n, dtype=np.float32)
    codec.decode(packet, out)
    np.testing.assert_array_equal(out, ref_dgc(x, 0.01, 0.01, 10, ctx))
    m = int(packet[4:8].view(np.uint32)[0])
    k = count_for(0.01, n)
    assert m <= k
    if n == 100_000:
        assert m >= 0.8 * k


def test_dgc_adapts_a_threshold_that_is_too_high():
    """Large values exactly where the strided sample looks: the sampled
    threshold passes only those, and DGC lowers it (x 0.8 per round) until at
    least 0.8 k entries pass -- or gives up after max_iters rounds."""
    n, ratio = 100_000, 0.02
    k = count_for(ratio, n)
    s = dgc_mod.dgc_sample_size(n, ratio, 0.01)
    stride = n // s
    ctx = EncodeContext(seed=3)
    key = stream_key(ctx.seed, ctx.rank, ctx.step, dgc_mod.SALT)
    start = int(hash_index_cpu(key, np.uint64(0)) % np.uint64(stride))
    x = data(n, 10) * np.float32(0.1)
    x[start:start + stride * (s - 1) + 1:stride] = 1.0
    assert s < 0.8 * k
    out = get_codec("dgc", ratio=ratio).roundtrip(x, ctx)
    np.testing.assert_array_equal(out, ref_dgc(x, ratio, 0.01, 10, ctx))
    assert 0.8 * k <= np.count_nonzero(out) <= k and np.count_nonzero(out == 1) == s
    # three rounds lower the threshold to 0.512: nothing else passes
    few = get_codec("dgc", ratio=ratio, max_iters=3).roundtrip(x, ctx)
    np.testing.assert_array_equal(few, ref_dgc(x, ratio, 0.01, 3, ctx))
    assert np.count_nonzero(few) == s


SAMPLED = {"topk": {}, "topk_exact": {"exact": True}, "topk_5": {"ratio": 0.05},
           "dgc": {}, "dgc_1": {"ratio": 0.01}, "dgc_3iters": {"ratio": 0.02, "max_iters": 3}}


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [30_001, 3 * 65_536 + 17, 400_000])
@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampled_selection_with_feedback_in_one_pass(case, n, residual):
    """Where topk's and dgc's threshold comes from a sample, the encode with
    feedback forms ``v = x + e``, collects its candidates and counts NaN/Inf
    in one pass (:func:`~hpccomm.kernels.sparsify.compensate_select`): packet
    and residual have the bits of the three steps (encode ``v``, decode,
    subtract), with zeros, ties, DGC's lowered thresholds (large values where
    the sample looks) and blocks cut mid-chunk."""
    codec = get_codec(case.split("_")[0], **SAMPLED[case])
    x = data(n, n)
    x[::7] = 0
    x[1::11] = np.float32(0.75)     # ties at many magnitudes' cut
    ctx = EncodeContext(seed=3, step=2, rank=1, offset=4097)
    if case == "dgc_3iters":
        s = dgc_mod.dgc_sample_size(n, codec.ratio, codec.sample_ratio)
        x[sparse_kernels.strided_positions(n, s, codec._key(ctx), ctx.offset)] = 8.0
    e = data(n, n + 1) * np.float32(0.5) if residual else None
    assert codec._sample_size(n, codec.max_count(n)) < n
    e_out = np.empty(n, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, ctx)
    v = x if e is None else x + e
    expect = codec.encode(v, ctx)
    assert packet.tobytes() == expect.tobytes()
    assert e_out.tobytes() == (v - codec.decode(expect, np.empty(n, np.float32))).tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("case", ["topk", "dgc"])
def test_sampled_selection_with_feedback_counts_nonfinite(case, bad):
    """The one-pass encode raises for NaN/Inf in ``v`` under ``"raise"`` and,
    under ``"propagate"``, gives the three steps' bits (an Inf is sent, a NaN
    never)."""
    n = 100_003
    x, e = data(n, 1), data(n, 2)
    e[70_001] = bad
    with pytest.raises(NonFiniteError):
        get_codec(case).encode_with_feedback(x, e, np.empty(n, np.float32), CTX)
    codec = get_codec(case, nonfinite="propagate")
    e_out = np.empty(n, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, CTX)
    expect = codec.encode(x + e, CTX)
    assert packet.tobytes() == expect.tobytes()
    with np.errstate(invalid="ignore"):
        ref = (x + e) - codec.decode(expect, np.empty(n, np.float32))
    assert e_out.tobytes() == ref.tobytes()


# ---------------------------------------------------------------------------
# threshold
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_threshold_fixed_tau_matches_numpy(n):
    x = data(n, 11)
    codec = get_codec("threshold", tau=0.5)
    cap = math.ceil(0.25 * n)
    np.testing.assert_array_equal(roundtrip(codec, x)[1], ref_threshold(x, 0.5, cap))


@pytest.mark.parametrize("n", SIZES)
def test_threshold_alpha_matches_numpy(n):
    x = data(n, 12)
    codec = get_codec("threshold", alpha=1.2, max_ratio=0.5)
    packet, out = roundtrip(codec, x)
    tau = np.float32(0)
    if n:
        tau = np.float32(1.2 * np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    if packet[4:8].view(np.uint32)[0]:
        # summation orders differ: the packet's tau is within rounding of numpy's
        sent = packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0]
        assert sent == pytest.approx(tau, rel=1e-6)
        tau = sent
    if n:
        np.testing.assert_array_equal(out, ref_threshold(x, tau, math.ceil(0.5 * n)))


def ref_sum_squares(x):
    """``sum(x_i^2)`` in the documented order (:func:`hpccomm.kernels.sparsify.
    _sum_squares`): per block, lane ``i mod 32`` in sequence, the lanes in
    order, then the tail; the blocks in order."""
    total = 0.0
    for lo in range(0, x.size, BLOCK):
        b = x[lo:lo + BLOCK].astype(np.float64)
        full = b.size - b.size % 32
        s = 0.0
        for lane in range(32):
            s += np.cumsum(b[lane:full:32] ** 2)[-1] if full else 0.0
        for v in b[full:]:
            s += v * v
        total += s
    return total


@pytest.mark.parametrize("n", [5, 1003, 3 * BLOCK + 1003])
def test_threshold_alpha_uses_the_documented_summation_order(n):
    """The float64 sum of squares bit for bit (plain, and fused: summed
    block by block while ``v`` is formed) over a few inputs (another order
    shows in the last bits of some of them), and the ``tau`` it gives."""
    for seed in range(8):
        x = data(n, seed) * np.float32(3)
        ss = ref_sum_squares(x)
        assert sparse_kernels.sum_squares(x) == ss
        assert sparse_kernels.compensate(x, None, np.empty(n, np.float32), True) == (0, ss)
    codec = get_codec("threshold", alpha=1.2)
    packet = codec.encode(x)
    sent = packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0]
    assert sent == np.float32(1.2 * math.sqrt(ss / n))
    fused = codec.encode_with_feedback(x, None, np.empty(n, np.float32), EncodeContext())
    assert fused.tobytes() == packet.tobytes()


@pytest.mark.parametrize("n", [5, 1003, 3 * BLOCK + 1003])
def test_threshold_alpha_takes_tau_from_the_fresh_gradient(n):
    """Under error feedback ``tau = alpha * RMS(g)`` of the fresh ``g``
    (``ctx.fresh``), not of ``v = g + e``: the fused kernel sums the squares
    of ``x`` while it forms ``v``, and gives the bits of encoding ``v`` with
    ``fresh=g``, decoding and subtracting."""
    g = data(n, 21)
    e = data(n, 22) * np.float32(5)           # a residual much larger than g
    v = g + e
    ss = ref_sum_squares(g)
    assert sparse_kernels.compensate(g, e, np.empty(n, np.float32), True)[1] == ss
    codec = get_codec("threshold", alpha=1.2)
    tau = np.float32(1.2 * math.sqrt(ss / n))
    packet = codec.encode(v, EncodeContext(fresh=g))
    assert packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0] == tau
    plain = codec.encode(v)                   # no fresh part: v's own RMS
    assert plain[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0] > 2 * tau
    e_out = np.empty(n, np.float32)
    fused = codec.encode_with_feedback(g, e, e_out, EncodeContext())
    assert fused.tobytes() == packet.tobytes()
    want = v - codec.decode(packet, np.empty(n, np.float32))
    assert e_out.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    idx, vals = codec.sparsify(v, EncodeContext(fresh=g))
    assert np.all(np.abs(vals) == tau) and idx.size == int(packet[4:8].view(np.uint32)[0])
    with pytest.raises(ValueError, match="fresh part"):
        codec.encode(v, EncodeContext(fresh=g[:-1]))


def test_threshold_cap_keeps_the_largest():
    x = np.array([0.6, -2.0, 0.7, 3.0, -0.6, 0.0, 1.0, -1.0], dtype=np.float32)
    out = get_codec("threshold", tau=0.5, max_ratio=0.375).roundtrip(x)  # cap 3
    np.testing.assert_array_equal(out, [0, -0.5, 0, 0.5, 0, 0, 0.5, 0])


@pytest.mark.parametrize("case", ["spread", "one block", "over the cap"])
@pytest.mark.parametrize("in_place", [False, True])
def test_threshold_with_feedback_in_one_pass(case, in_place):
    """threshold's encode with feedback takes its quanta in the pass that
    forms ``v`` (:func:`~hpccomm.kernels.sparsify.compensate_sign_quanta`):
    the bits of the three steps (encode ``v``, decode, subtract) when the
    candidates are spread; when one block holds more than its share of the
    scratch, or more than the capacity qualify, ``v`` is restored exactly
    and the capped selection runs from it.  The residual may be updated in
    place (``e_out`` is ``e``)."""
    n = 3 * BLOCK + 1003
    codec = get_codec("threshold", tau=1.0, max_ratio=0.05)
    cap = codec.max_count(n)
    x = data(n, 5) * np.float32(0.25)
    x[::997] = np.float32(-1.5)
    if case == "one block":              # 8000 > the block's share, < cap
        x[BLOCK:BLOCK + 8000] = np.where(np.arange(8000) % 3, 2.0, -2.5)
    elif case == "over the cap":
        x[::9] = np.float32(1.25)
        x[5::90] = np.float32(3.0)
    e = data(n, 6) * np.float32(0.2)
    v = x + e
    expect = codec.encode(v, CTX)
    want_e = v - codec.decode(expect, np.empty(n, np.float32))
    vv = np.empty(n, np.float32)
    write, m, bad = sparse_kernels.compensate_sign_quanta(x, e, vv, np.float32(1.0), cap,
                                                          np.dtype(np.uint32))
    assert (write is None) == (case != "spread") and bad == 0
    assert (m > cap) == (case == "over the cap")
    if write is None:
        assert vv.tobytes() == v.tobytes()
    e_in = e.copy()
    e_out = e_in if in_place else np.empty(n, np.float32)
    packet = codec.encode_with_feedback(x, e_in, e_out, CTX)
    assert packet.tobytes() == expect.tobytes()
    assert e_out.tobytes() == want_e.tobytes()


def test_threshold_summable_form():
    codec = get_codec("threshold", tau=0.5)
    xs = [data(300, r) for r in range(3)]
    codes = [codec.to_summable(x, None, EncodeContext(rank=r)) for r, x in enumerate(xs)]
    assert codec.shared_scale(xs[0]) is None and codes[0].dtype == np.int8
    assert set(np.unique(codes[0])) <= {-1, 0, 1}
    total = np.sum([c.astype(codec.summable_dtype(3)) for c in codes], axis=0)
    out = codec.from_summable(total, None, np.empty(300, np.float32))
    uncapped = get_codec("threshold", tau=0.5, max_ratio=1.0)
    np.testing.assert_array_equal(out, np.sum([uncapped.roundtrip(x) for x in xs], axis=0))
    assert [codec.summable_dtype(p) for p in (1, 127, 128, 32767, 32768)] == \
        [np.int8, np.int8, np.int16, np.int16, np.int32]
    with pytest.raises(ValueError, match="fixed tau"):
        get_codec("threshold", alpha=1.0).to_summable(xs[0], None, CTX)


# ---------------------------------------------------------------------------
# randk
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_randk_indices_are_shared_distinct_and_sorted(n):
    codec = get_codec("randk", ratio=0.1)
    x = data(n, 13)
    k = count_for(0.1, n)
    ranks = [codec.sparsify(x, EncodeContext(seed=4, rank=r, step=6, offset=50))
             for r in range(3)]
    for idx, vals in ranks:
        np.testing.assert_array_equal(idx, ranks[0][0])
        assert idx.size == k and np.all(np.diff(idx) > 0)
        if k:
            assert 0 <= idx[0] and idx[-1] < n
            np.testing.assert_array_equal(vals, x[idx] * np.float32(n / k))
    if n >= 100:
        other = codec.sparsify(x, EncodeContext(seed=4, rank=0, step=7, offset=50))[0]
        assert not np.array_equal(other, ranks[0][0])


def test_randk_is_unbiased_and_uniform():
    n, steps = 40, 3000
    x = data(n, 14)
    codec = get_codec("randk", ratio=0.1)  # k = 4: values scaled by 10
    total = np.zeros(n)
    hits = np.zeros(n)
    for step in range(steps):
        out = codec.roundtrip(x, EncodeContext(seed=1, step=step))
        total += out
        hits += out != 0
    se = np.abs(x) * np.sqrt(n / 4 - 1) / np.sqrt(steps)
    assert np.all(np.abs(total / steps - x) <= 5 * se + 1e-6)
    p = 4 / n
    assert np.all(np.abs(hits / steps - p) <= 5 * np.sqrt(p * (1 - p) / steps))


def test_randk_biased_sends_plain_values():
    x = data(100, 15)
    out = get_codec("randk", ratio=0.1, unbiased=False).roundtrip(x, CTX)
    assert np.count_nonzero(out) == 10
    np.testing.assert_array_equal(out[out != 0], x[out != 0])


def test_randk_under_feedback_sends_plain_values():
    """Under error feedback (``ctx.feedback``) the unbiased codec sends the
    contractive ``C / (1 + omega)``, ``omega = n / k - 1``: the values as
    they are, in the packet, the pairs and the summable form alike."""
    x = data(100, 15)
    codec = get_codec("randk", ratio=0.1)
    ctx = replace(CTX, feedback=True)
    out = codec.roundtrip(x, ctx)
    assert np.count_nonzero(out) == 10
    np.testing.assert_array_equal(out[out != 0], x[out != 0])
    assert codec.encode(x, ctx).tobytes() == \
        get_codec("randk", ratio=0.1, unbiased=False).encode(x, CTX).tobytes()
    idx, vals = codec.sparsify(x, ctx)
    np.testing.assert_array_equal(vals, x[idx])
    np.testing.assert_array_equal(codec.to_summable(x, None, ctx)[:10], x[idx])


def test_randk_summable_form():
    codec = get_codec("randk", ratio=0.1)
    n, P = 333, 4
    xs = [data(n, r) for r in range(P)]
    parts = [codec.to_summable(x, None, EncodeContext(seed=2, rank=r, step=5))
             for r, x in enumerate(xs)]
    assert codec.shared_scale(xs[0]) is None and codec.summable_dtype(P) == np.float32
    total = np.sum(parts, axis=0, dtype=np.float32)
    out = codec.from_summable(total, None, np.full(n, np.nan, np.float32))
    expect = np.zeros(n, dtype=np.float32)
    for r, x in enumerate(xs):
        codec.decode_add(codec.encode(x, EncodeContext(seed=2, rank=r, step=5)), expect)
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)
    own = codec.from_summable(parts[0], None, np.empty(n, np.float32))
    np.testing.assert_array_equal(own, codec.roundtrip(xs[0], EncodeContext(seed=2, step=5)))
    # ranks at different steps: the key bytes no longer divide by P
    mixed = parts[0] + codec.to_summable(xs[1], None, EncodeContext(seed=2, rank=1, step=6))
    with pytest.raises(PacketError):
        codec.from_summable(mixed, None, np.empty(n, np.float32))
    with pytest.raises(PacketError):
        codec.from_summable(total[:-1], None, np.empty(n, np.float32))
    bad = total.copy()
    bad[-9] = 0.5
    with pytest.raises(PacketError):
        codec.from_summable(bad, None, np.empty(n, np.float32))


# ---------------------------------------------------------------------------
# adaptive
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pi,H", [(4, 10), (2, 7), (64, 100), (8, 33)])
def test_adaptive_exact_columns_match_numpy(n, pi, H):
    """Columns of at most 8 pi rows are selected exactly (no sampling)."""
    x = data(n, 16)
    codec = get_codec("adaptive", proportion=pi, col_len=H)
    assert H <= codec.samples
    np.testing.assert_array_equal(roundtrip(codec, x)[1], ref_adaptive(x, min(H, n), pi, 4))


@pytest.mark.parametrize("n", [1000, 4097, 20_000])
@pytest.mark.parametrize("pi,H,excess", [(4, 100, 4), (2, 300, 1), (16, 4096, 4), (8, 999, 2)])
@pytest.mark.parametrize("kind", ["normal", "ties", "plateau"])
def test_adaptive_sampled_columns_match_numpy(n, pi, H, excess, kind):
    """Columns longer than the sample (``8 pi``) against the reference with
    the documented draws, bit for bit.  Rounded data puts ties at the
    thresholds; a plateau (most magnitudes exactly 1, a few larger ones
    scattered) makes the sampled threshold 1, so a side overflows its cap and
    is cut to the largest entries plus the first ties."""
    x = data(n, 19)
    if kind == "ties":
        x = np.round(x * 2).astype(np.float32)
    elif kind == "plateau":
        x = np.where(np.abs(x) < 1.6, np.sign(x), x).astype(np.float32)
    codec = get_codec("adaptive", proportion=pi, col_len=H, excess=excess)
    ctx = EncodeContext(seed=3, rank=2, step=5, offset=77)
    assert min(H, n) > codec.samples
    np.testing.assert_array_equal(roundtrip(codec, x, ctx)[1],
                                  ref_adaptive(x, min(H, n), pi, excess, codec.samples, ctx))


@pytest.mark.parametrize("shape", [(4, 2500), (2, 5000), (10_000,), ()])
def test_adaptive_sampled_columns(shape):
    """Long columns sample their threshold.  Whatever it is: per sign, every
    sent entry is at least every unsent one, at most cap(h) are sent, and the
    reconstruction is the float32 mean of the sent entries."""
    pi = 16
    x = data(10_000, 17)
    codec = get_codec("adaptive", proportion=pi)
    ctx = EncodeContext(seed=1, shape=shape)
    H = codec.column_length(x.size, shape)
    assert H == (shape[-1] if len(shape) == 2 else VECTOR_COLUMN) and H > codec.samples
    out = codec.roundtrip(x, ctx)
    for lo in range(0, x.size, H):
        col, dec = x[lo:lo + H], out[lo:lo + H]
        cap = 4 * math.ceil(H / pi)
        for sign in (1, -1):
            sent = (dec * sign > 0)
            vals = col[sent] * sign
            rest = col[~sent & (col * sign > 0)] * sign
            assert 0 < sent.sum() <= cap
            assert rest.size == 0 or vals.min() >= rest.max()
            assert np.all(dec[sent] == np.float32(col[sent].astype(np.float64).mean()))
            # about 1/pi of that sign's entries
            assert 0.2 / pi < sent.sum() / max(1, np.sum(col * sign > 0)) < 4.0 / pi


def test_adaptive_columns_follow_shape_and_align():
    codec = get_codec("adaptive", proportion=4)
    assert codec.align((3, 7)) == 7
    assert codec.align((50,)) == VECTOR_COLUMN and codec.align(()) == VECTOR_COLUMN
    assert codec.column_length(21, (3, 7)) == 7 and codec.column_length(21, ()) == 21
    assert codec.column_length(3 * VECTOR_COLUMN + 1, (3 * VECTOR_COLUMN + 1,)) == VECTOR_COLUMN
    assert codec.column_length(5, (3, 7)) == 5
    assert get_codec("adaptive", col_len=9).align((3, 7)) == 9
    packet = codec.encode(data(21), EncodeContext(shape=(3, 7)))
    assert int(packet[16:20].view(np.uint32)[0]) == 7


@pytest.mark.parametrize("shape", [(5000,), (40, 125), (3, 1001)])
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties"])
def test_adaptive_capacity_holds_every_packet_of_its_shape(shape, kind):
    """``capacity_for(m, shape)`` (a slot of twoshot's small calls) holds the
    packet of any chunk of ``m`` elements of a tensor of ``shape``, and
    stays below ``max_wire_size`` (every column length)."""
    codec = get_codec("adaptive", proportion=8, excess=2)
    rng = np.random.default_rng(len(shape))
    n = int(np.prod(shape))
    x = {"normal": rng.standard_normal(n), "heavy": rng.standard_cauchy(n),
         "ties": rng.integers(-2, 3, n)}[kind].astype(np.float32)
    for m in (1, 7, 125, 1001, n):
        packet = codec.encode(x[:m], EncodeContext(shape=shape, step=3))
        assert packet.size <= codec.capacity_for(m, shape) <= codec.max_wire_size(m), m
    tight = x.copy()          # every column's largest: the cap of both signs filled
    tight[::2] = np.abs(tight[::2]) + 1
    tight[1::2] = -np.abs(tight[1::2]) - 1
    assert codec.encode(tight, EncodeContext(shape=shape)).size <= codec.capacity_for(n, shape)


def test_adaptive_chunks_of_whole_columns_encode_like_the_whole():
    codec = get_codec("adaptive", proportion=4, col_len=500)  # 500 > 32 samples
    x = data(3000, 18)
    ctx = EncodeContext(seed=9, rank=2, step=1)
    whole = codec.roundtrip(x, ctx)
    for lo, hi in ((0, 1000), (1000, 2500), (2500, 3000)):
        part_ctx = EncodeContext(seed=9, rank=2, step=1, offset=lo)
        np.testing.assert_array_equal(codec.roundtrip(x[lo:hi], part_ctx), whole[lo:hi])


def test_adaptive_one_sign_only_and_constant_columns():
    codec = get_codec("adaptive", proportion=4, col_len=8)
    x = np.array([1, 2, 3, 4, 5, 6, 7, 8] + [2] * 8, dtype=np.float32)
    out = codec.roundtrip(x)
    np.testing.assert_array_equal(out[:8], [0, 0, 0, 0, 0, 0, 7.5, 7.5])
    # constant column: all 8 tie at the threshold; cap(8) = 8 keeps them all
    np.testing.assert_array_equal(out[8:], [2] * 8)
    tight = get_codec("adaptive", proportion=4, col_len=8, excess=1)  # cap 2
    np.testing.assert_array_equal(tight.roundtrip(x)[8:], [2, 2, 0, 0, 0, 0, 0, 0])
    # sampled columns (1000 rows > 32 samples) are cut the same way: cap 250
    long = np.concatenate([np.full(1000, -3, np.float32), np.full(1000, 3, np.float32)])
    out = get_codec("adaptive", proportion=4, col_len=1000, excess=1).roundtrip(long)
    expect = np.zeros(2000, np.float32)
    expect[:250], expect[1000:1250] = -3, 3
    np.testing.assert_array_equal(out, expect)


# ---------------------------------------------------------------------------
# shared properties
# ---------------------------------------------------------------------------
def feedback_invariant_error(codec, memory, fuse, n=2000, steps=6):
    """Six calls of the library's worker-side error feedback
    (:class:`~hpccomm.collectives.base.Contribution` with ``memory``: ``v = g
    + e``, encode, ``e = v - decode``; fused into the codec's
    ``encode_with_feedback`` with ``fuse``): what was decoded plus the final
    residual must add up to what came in.  Returns the largest deviation over
    the allowed rounding (> 0: the invariant fails)."""
    from hpccomm.collectives.base import Contribution
    from hpccomm.state import KeyState
    from hpccomm.stats import CallStats

    state, scratch = KeyState(), {}
    sent = np.zeros(n, dtype=np.float64)
    total_in = np.zeros(n, dtype=np.float64)
    for step in range(steps):
        g = data(n, 100 + step)
        total_in += g
        work = Contribution(codec, memory, state, g,
                            lambda name, m: scratch.setdefault(name, np.empty(m, np.float32)),
                            fuse=fuse)
        packet = work.encode(0, n, EncodeContext(seed=1, step=step, shape=(20, 100)))
        d = codec.decode(packet, np.empty(n, dtype=np.float32))
        work.commit(CallStats())
        sent += d
    e = state.residuals.get("worker", np.zeros(n, np.float32)).astype(np.float64)
    tol = 1e-4 * (1 + np.abs(total_in).max())
    return float(np.max(np.abs(sent + e - total_in)) - tol)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_error_feedback_invariant(case, fuse):
    """The residual memory through the library's bracket keeps everything
    that did not go out: sum of decoded + final residual = sum of inputs."""
    from hpccomm.memory import get_memory

    assert feedback_invariant_error(codec_of(case), get_memory("residual"), fuse) <= 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_all_zero_input(case, n):
    codec = codec_of(case)
    x = np.zeros(n, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packet, out = roundtrip(codec, x)
    np.testing.assert_array_equal(out, x)
    if not codec.fixed_size:
        assert int(packet[4:8].view(np.uint32)[0]) == 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_raises(case, bad):
    codec = codec_of(case)
    x = data(100)
    x[37] = bad
    with pytest.raises(NonFiniteError):
        codec.encode(x, CTX)
    with pytest.raises(NonFiniteError):
        codec.sparsify(x, CTX)


@pytest.mark.parametrize("case", ["topk", "dgc", "threshold_tau", "adaptive"])
def test_nonfinite_propagate_never_sends_nan(case):
    codec = get_codec(case.split("_")[0], nonfinite="propagate", **CASES[case])
    x = data(1000)
    x[5] = np.nan
    out = codec.roundtrip(x, CTX)
    assert not np.isnan(out).any()


# ---------------------------------------------------------------------------
# corrupt packets
# ---------------------------------------------------------------------------
GUARD = 64


def guarded_decode(codec, packet, n, add):
    """Decode into the middle of a sentinel-filled buffer; the sentinels must
    survive whatever happens."""
    buf = np.full(n + 2 * GUARD, 7.25, dtype=np.float32)
    out = buf[GUARD:GUARD + n]
    try:
        (codec.decode_add if add else codec.decode)(packet, out)
    except PacketError:
        pass
    assert np.all(buf[:GUARD] == 7.25) and np.all(buf[GUARD + n:] == 7.25)


def set_u32(packet, offset, value):
    p = packet.copy()
    p[offset:offset + 4] = np.frombuffer(np.uint32(value).tobytes(), np.uint8)
    return p


@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_packets_raise(case):
    codec = codec_of(case)
    n = 1000
    ctx = EncodeContext(seed=1, shape=(10, 100))
    packet = codec.encode(data(n, 19), ctx)
    out = np.empty(n, dtype=np.float32)
    bad = [packet[:-1], packet[:HEADER_SIZE - 1], np.concatenate([packet, packet[:4]]),
           set_u32(packet, 4, 0xFFFFFFFF), set_u32(packet, 4, n + 1), packet[:HEADER_SIZE]]
    wrong_id = packet.copy()
    wrong_id[3] = 0
    bad.append(wrong_id)
    wrong_n = packet.copy()
    wrong_n[8] ^= 1
    bad.append(wrong_n)
    for p in bad:
        with pytest.raises(PacketError):
            codec.decode(p, out)
    with pytest.raises(PacketError):
        codec.decode(packet.view(np.int8), out)


@pytest.mark.parametrize("case", ["topk", "dgc", "threshold_tau"])
@pytest.mark.parametrize("where,indices", [
    ("first", [1000]), ("first", [2 ** 30]), ("last", [1000]), ("first", [5, 4]),
    ("first", [3, 3]), ("last", [0])])
def test_bad_indices_raise_before_writing(case, where, indices):
    codec = codec_of(case)
    n = 1000
    packet = codec.encode(data(n, 20))
    first = {"topk": HEADER_SIZE, "dgc": HEADER_SIZE, "threshold": 24}[codec.name]
    shift = 1 if codec.name == "threshold" else 0
    m = int(packet[4:8].view(np.uint32)[0])
    assert m >= 3
    words = packet[first:first + 4 * m].view(np.uint32)  # a view: edits the packet
    at = 0 if where == "first" else m - len(indices)
    words[at:at + len(indices)] = np.array(indices, dtype=np.uint32) << shift
    out = np.full(n, 3.5, dtype=np.float32)
    with pytest.raises(PacketError, match="increasing"):
        codec.decode_add(packet, out)
    assert np.all(out == 3.5)


def test_threshold_header_fields_are_checked():
    codec = get_codec("threshold", tau=0.5)
    packet = codec.encode(data(500))
    for value in (np.float32(np.nan), np.float32(-1), np.float32(np.inf)):
        p = packet.copy()
        p[16:20] = np.frombuffer(value.tobytes(), np.uint8)
        with pytest.raises(PacketError):
            codec.decode(p, np.empty(500, np.float32))
    with pytest.raises(PacketError):
        codec.decode(set_u32(packet, 20, 1), np.empty(500, np.float32))


def test_adaptive_header_fields_are_checked():
    codec = get_codec("adaptive", proportion=4)
    n = 1000
    packet = codec.encode(data(n), EncodeContext(shape=(10, 100)))
    out = np.full(n, 1.5, dtype=np.float32)
    W = 10
    cases = [set_u32(packet, 16, 0), set_u32(packet, 16, n + 1), set_u32(packet, 16, 99),
             packet[:19]]
    # move one entry from column 0 to column 1: counts still add up
    c0 = int(packet[20:24].view(np.uint32)[0])
    c1 = int(packet[32:36].view(np.uint32)[0])
    cases.append(set_u32(set_u32(packet, 20, c0 - 1), 32, c1 + 1))
    cases.append(set_u32(packet, 20, c0 + 1))
    words_at = 20 + 12 * W
    p = packet.copy()
    p[words_at:words_at + 4] = np.frombuffer(np.uint32(100 << 1).tobytes(), np.uint8)  # row 100
    cases.append(p)
    p = packet.copy()
    w = p[words_at:words_at + 8].view(np.uint32)
    w[1] = w[0]  # repeated row
    cases.append(p)
    for p in cases:
        with pytest.raises(PacketError):
            codec.decode_add(p, out)
        assert np.all(out == 1.5)


def test_randk_count_and_key():
    codec = get_codec("randk", ratio=0.1)
    packet = codec.encode(data(1000), CTX)
    with pytest.raises(PacketError):
        codec.decode(set_u32(packet, 4, 99), np.empty(1000, np.float32))
    # any key is safe: it only chooses other (valid) indices
    p = packet.copy()
    p[16:24] = 0xAB
    out = np.empty(1000, dtype=np.float32)
    codec.decode(p, out)
    assert np.count_nonzero(out) <= 100


@st.composite
def mutations(draw, packet):
    """A packet with one random corruption."""
    kind = draw(st.sampled_from(["truncate", "extend", "bytes", "count", "payload_word",
                                 "codec_id"]))
    p = packet.copy()
    if kind == "truncate":
        return p[:draw(st.integers(0, max(0, p.size - 1)))]
    if kind == "extend":
        extra = draw(st.binary(min_size=1, max_size=64))
        return np.concatenate([p, np.frombuffer(extra, np.uint8)])
    if kind == "bytes":
        for _ in range(draw(st.integers(1, 8))):
            p[draw(st.integers(0, p.size - 1))] = draw(st.integers(0, 255))
        return p
    if kind == "count":
        return set_u32(p, 4, draw(st.one_of(st.integers(0, 4000),
                                            st.integers(0, 2 ** 32 - 1))))
    if kind == "payload_word" and p.size >= HEADER_SIZE + 8:
        at = draw(st.integers(HEADER_SIZE, p.size - 4))
        return set_u32(p, at, draw(st.integers(0, 2 ** 32 - 1)))
    p[3] = draw(st.integers(0, 255))
    return p


FUZZ_N = 300


@pytest.mark.parametrize("case", ["topk", "dgc", "threshold_tau", "randk", "adaptive"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_packets_never_write_out_of_bounds(case, fuzz):
    codec = codec_of(case)
    x = data(FUZZ_N, 21)
    packet = codec.encode(x, EncodeContext(seed=1, shape=(30, 10)))
    bad = fuzz.draw(mutations(packet))
    guarded_decode(codec, bad, FUZZ_N, add=fuzz.draw(st.booleans()))


# ---------------------------------------------------------------------------
# DGC momentum helper
# ---------------------------------------------------------------------------
class RefDGC:
    """Momentum correction and masking in plain numpy, fed the helper's selections."""

    def __init__(self, shape, m, nesterov):
        self.u = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.m, self.nesterov = np.float32(m), nesterov

    def step(self, g):
        if self.nesterov:
            self.u = (self.u + g) * self.m
            self.v = self.v + self.u + g
        else:
            self.u = self.m * self.u + g
            self.v = self.v + self.u
        return self.v.copy()

    def mask(self, sent):
        self.u[sent] = 0
        self.v[sent] = 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_momentum_correction_and_masking(nesterov):
    shapes = {"w": (20, 30), "b": (30,)}
    helper = DGCMomentum(shapes, momentum=0.9, ratio=0.05, warmup_epochs=0, nesterov=nesterov,
                         seed=3, rank=1)
    refs = {k: RefDGC(s, 0.9, nesterov) for k, s in shapes.items()}
    rng = np.random.default_rng(0)
    for step in range(5):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        to_send = helper.accumulate(grads, epoch=0)
        for k, s in shapes.items():
            v = refs[k].step(grads[k])
            sent = to_send[k] != 0
            assert to_send[k].shape == s
            assert 0 < sent.sum() <= math.ceil(0.05 * v.size)
            np.testing.assert_array_equal(to_send[k][sent], v[sent])
            # DGC's selection of v (the same sampled threshold as the codec)
            ctx = EncodeContext(seed=3, rank=1, step=step)
            np.testing.assert_array_equal(to_send[k].ravel(),
                                          ref_dgc(v.ravel(), 0.05, 0.01, 10, ctx))
            refs[k].mask(sent)
            to_send[k][...] = -1  # what a reduce in place leaves: never read
        helper.sent(to_send)
        for k in shapes:
            np.testing.assert_allclose(helper.u[k], refs[k].u, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(helper.v[k], refs[k].v, rtol=1e-6, atol=1e-6)


def test_dgc_masking_zeroes_sent_positions_only():
    helper = DGCMomentum({"w": (100,)}, momentum=0.5, ratio=0.1, warmup_epochs=0)
    g = np.arange(1, 101, dtype=np.float32)
    sent = helper.accumulate({"w": g})["w"] != 0
    c = int(sent.sum())
    assert 8 <= c <= 10  # DGC's band [0.8 k, k], k = 10: the largest ones
    np.testing.assert_array_equal(np.flatnonzero(sent), np.arange(100 - c, 100))
    helper.sent(["w"])
    assert np.all(helper.u["w"][sent] == 0) and np.all(helper.v["w"][sent] == 0)
    np.testing.assert_array_equal(helper.u["w"][~sent], g[~sent])
    np.testing.assert_array_equal(helper.v["w"][~sent], g[~sent])
    unmasked = DGCMomentum({"w": (100,)}, momentum=0.5, ratio=0.1, warmup_epochs=0,
                           masking=False)
    unmasked.accumulate({"w": g})
    unmasked.sent()
    np.testing.assert_array_equal(unmasked.u["w"], g)
    with pytest.raises(KeyError):
        unmasked.sent(["w"])


def test_dgc_warmup_schedule():
    got = [warmup_density(e, 0.001, 4) for e in range(7)]
    np.testing.assert_allclose(got[:5], [0.001 ** (k / 5) for k in range(1, 6)])
    np.testing.assert_allclose(got[:4], [0.25, 0.063, 0.0158, 0.004], rtol=0.01)
    assert got[4:] == [0.001] * 3
    assert warmup_density(0, 0.01, 0) == 0.01
    explicit = DGCMomentum({"w": (4,)}, schedule=[0.25, 0.0625, 0.015625], ratio=0.001)
    assert [explicit.density(e) for e in range(5)] == [0.25, 0.0625, 0.015625, 0.001, 0.001]
    helper = DGCMomentum({"w": (1000,)}, ratio=0.001, warmup_epochs=4)
    g = {"w": data(1000, 22)}
    assert np.count_nonzero(helper.accumulate(g, epoch=0)["w"]) <= 252
    assert np.count_nonzero(helper.accumulate(g, epoch=0)["w"]) >= 0.8 * 252
    assert np.count_nonzero(helper.accumulate(g, epoch=9)["w"]) == 1


def test_dgc_clipping_and_state():
    shapes = {"a": (50,), "b": (5, 10)}
    helper = DGCMomentum(shapes, momentum=0.0, ratio=1.0, warmup_epochs=0, clip_norm=2.0,
                         nranks=4)
    grads = {k: np.full(s, 3.0, np.float32) for k, s in shapes.items()}
    out = helper.accumulate(grads)
    norm = math.sqrt(sum(float(np.sum(o.astype(np.float64) ** 2)) for o in out.values()))
    assert norm == pytest.approx(1.0, rel=1e-6)  # 2 / sqrt(4)
    helper.sent()
    helper.accumulate(grads)
    saved = helper.state_dict()
    other = DGCMomentum(shapes, momentum=0.0, ratio=1.0, warmup_epochs=0)
    other.load_state_dict(saved)
    assert other.step == 2 and not other.pending
    for k in shapes:
        np.testing.assert_array_equal(other.v[k], helper.v[k])
    with pytest.raises(KeyError):
        helper.accumulate({"c": np.zeros(3, np.float32)})
    with pytest.raises(ValueError):
        helper.accumulate({"a": np.zeros(3, np.float32)})


def test_dgc_helper_with_topk_transport_is_lossless():
    """The recommended transport (topk, ratio 1) carries the helper's
    selection exactly, chunked or not."""
    helper = DGCMomentum({"w": (4000,)}, ratio=0.01, warmup_epochs=0)
    send = helper.accumulate({"w": data(4000, 23)})["w"]
    carrier = hpccomm.get_codec("topk", ratio=1.0)
    out = np.empty(4000, dtype=np.float32)
    for lo, hi in ((0, 1500), (1500, 4000)):
        carrier.decode(carrier.encode(send[lo:hi]), out[lo:hi])
    np.testing.assert_array_equal(out, send)


# ---------------------------------------------------------------------------
# GPU kernels on numba's CUDA simulator (fresh interpreter: the variable must
# be set before numba is imported)
# ---------------------------------------------------------------------------
def _cuda_sparse_check():
    """Run with NUMBA_ENABLE_CUDASIM=1: the GPU kernels give the CPU's bits."""
    from numba import config, cuda

    from hpccomm.kernels import cuda_sparsify as G
    from hpccomm.kernels import sparsify as K

    assert config.ENABLE_CUDASIM
    for n in (0, 7, 2 * G.TILE + 5):  # the last spans three tiles
        x = data(n, 30)
        if n > 6:
            x[3], x[4], x[5], x[6] = 1.0, -1.0, 0.0, -0.0
        base = data(n, 31)
        for t in (0.0, 1.0):
            idx, vals = K.select_abs_ge(x, t, np.int32)
            gi, gv = G.select_abs_ge(x, t, np.int32)
            np.testing.assert_array_equal(gi.copy_to_host(), idx)
            np.testing.assert_array_equal(gv.copy_to_host(), vals)
            words = np.empty(idx.size, dtype=np.uint32)
            K.pack_sign_words(idx, vals, words)
            np.testing.assert_array_equal(G.pack_sign_words(idx, vals, np.uint32).copy_to_host(),
                                          words)
            for add in (False, True):
                want = base.copy()
                K.scatter(want, idx, vals, add)
                got = G.scatter(cuda.to_device(base), idx, vals, add).copy_to_host()
                np.testing.assert_array_equal(got, want)
                want = base.copy()
                K.scatter_sign_words(words, np.float32(0.5), want, add)
                got = G.scatter_sign_words(words, 0.5, cuda.to_device(base), add).copy_to_host()
                np.testing.assert_array_equal(got, want)


def test_cuda_kernels_match_cpu_on_the_simulator():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    probe = subprocess.run([sys.executable, "-c", "from numba import cuda; cuda.to_device"],
                           env=env, capture_output=True, text=True, timeout=120)
    if probe.returncode:
        pytest.skip(f"numba.cuda simulator unavailable: {probe.stderr.strip()[-200:]}")
    proc = subprocess.run([sys.executable, "-c", "from tests.test_codecs_sparse import "
                           "_cuda_sparse_check; _cuda_sparse_check()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("unbiased", [True, False])
def test_randk_reencode_of_decoded_sums_is_lossless(unbiased):
    """twoshot's owner stage: a sum of randk packets of one step and offset is
    zero off the shared indices and must come back exactly (no second n/k scale)."""
    c = get_codec("randk", ratio=0.05, unbiased=unbiased)
    n, offset = 1001, 384
    rng = np.random.default_rng(5)
    acc = np.zeros(n, dtype=np.float32)
    for r in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        c.decode_add(c.encode(x, EncodeContext(seed=3, rank=r, step=2, offset=offset)), acc)
    assert np.count_nonzero(acc) == c.count(n)
    packet = c.reencode(acc, EncodeContext(seed=3, rank=7, step=2, offset=offset))
    assert packet.size == c.wire_size(n)
    np.testing.assert_array_equal(c.decode(packet, np.empty(n, dtype=np.float32)), acc)


@pytest.mark.parametrize("algorithm", ["allgather", "twoshot"])
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("n", [1 << 14, 1 << 16, 1 << 18, 1 << 20])
def test_threshold_first_call_lies_in_its_band_when_few_entries_are_sent(n, P, algorithm):
    """``threshold`` at its default alpha = 4 sends about 6e-5 of N(0, 1)
    entries (1 to 66 per rank here): how many is Poisson, and ``twoshot``'s
    owner sends the few it receives at alpha times their sum's RMS, far below
    the workers' tau.  ``bench allreduce --check`` failed both at 64 KiB and
    256 KiB before the band said so."""
    from hpccomm import reference as R

    codec = get_codec("threshold")
    band = R.error_band(codec, algorithm, P, n, (n,))
    assert band is not None and band.gain[1] > 0
    for seed in range(3):
        rng = np.random.default_rng([n, P, seed])
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(P)]
        got = R.simulate(codec, algorithm, xs, shape=(n,))
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        assert R.check_band(got, exact, band) is None, (seed, band)
