"""The quantizing codecs fp16, bf16, onebit, terngrad and qsgd (no MPI).

Each codec is checked against a plain numpy reference written here from the
layouts in the codec modules' docstrings (bit-exact packets: every codec is
deterministic given the counter-based random numbers), then for error bounds,
exact cases, unbiasedness, the summable form, non-finite input, and corrupt
packets (hypothesis).
"""
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hpccomm
from hpccomm.codecs.base import HEADER, HEADER_SIZE, VECTOR_COLUMN, EncodeContext
from hpccomm.codecs.randk import index_key, random_indices
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels.rng import stream_key, uniform_array

SIZES = [0, 1, 7, 31, 33, 100, 1000, 4097]
CTX = EncodeContext(seed=7, rank=3, step=11, offset=5)

#: (codec name, parameters) covering every layout variant
VARIANTS = [
    ("fp16", {}),
    ("bf16", {}),
    ("onebit", {}),
    ("onebit", {"col_len": 7}),
    ("onebit", {"col_len": 64}),
    ("terngrad", {}),
    ("terngrad", {"clip": None}),
    ("qsgd", {}),
    ("qsgd", {"bits": 2, "bucket": 7}),
    ("qsgd", {"bits": 4, "bucket": 33, "norm": "max"}),
    ("qsgd", {"bits": 8, "bucket": 100}),
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for name, p in VARIANTS]


def make(name, params, **extra):
    return hpccomm.get_codec(name, **params, **extra)


def data(n, seed=0):
    rng = np.random.default_rng(seed + n)
    x = rng.standard_normal(n).astype(np.float32)
    if n > 10:  # a few exact zeros, large and tiny values
        x[3] = 0.0
        x[4] *= 50
        x[5] *= 1e-6
    return x


def decode(codec, packet, n):
    return codec.decode(packet, np.empty(n, dtype=np.float32))


# ---------------------------------------------------------------------------
# numpy reference implementations
# ---------------------------------------------------------------------------
def ref_header(codec_id, n, extra=0):
    h = np.zeros(1, dtype=HEADER)
    h["magic"], h["version"], h["codec"], h["extra"], h["n"] = b"HC", 1, codec_id, extra, n
    return h.view(np.uint8)


def pack_lsb_first(codes, bits):
    """``bits``-bit codes (two's complement), element i at bit (i bits) mod 8
    of byte (i bits) // 8."""
    per = 8 // bits
    c = (np.asarray(codes, dtype=np.int64) & ((1 << bits) - 1)).astype(np.uint8)
    c = np.concatenate([c, np.zeros(-c.size % per, dtype=np.uint8)]).reshape(-1, per)
    shifts = (np.arange(per) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(c << shifts, axis=1).astype(np.uint8)


def unpack_lsb_first(payload, bits, n):
    per = 8 // bits
    b = np.repeat(payload.astype(np.int64), per)[:n]
    raw = (b >> ((np.arange(n) % per) * bits)) & ((1 << bits) - 1)
    half = 1 << (bits - 1)
    return (raw ^ half) - half


def ref_fp16(x, codec_id=1):
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    big = np.isinf(h) & np.isfinite(x)
    h[big] = np.copysign(np.float16(65504), x[big])
    return np.concatenate([ref_header(codec_id, x.size), h.view(np.uint8)])


def ref_bf16(x):
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    big = ((u & 0x7FFFFFFF) >= 0x7F7F8000) & ((u & 0x7FFFFFFF) < 0x7F800000)
    r[big] = ((u[big] >> 16) & 0x8000) | 0x7F7F
    return np.concatenate([ref_header(2, x.size), r.view(np.uint8)])


def ref_onebit(x, col_len):
    n = x.size
    H = min(col_len, max(n, 1))
    means = []
    for lo in range(0, n, H):
        col = x[lo:lo + H].astype(np.float64)
        pos, neg = col[col >= 0], col[col < 0]
        means += [pos.sum() / max(pos.size, 1), neg.sum() / max(neg.size, 1)]
    means = np.array(means, dtype=np.float32)
    bits = np.packbits(x >= 0, bitorder="little")
    bits = np.concatenate([bits, np.zeros(-bits.size % 4, dtype=np.uint8)])
    return np.concatenate([ref_header(3, n, H), means.view(np.uint8), bits])


def ref_onebit_decode(x, col_len):
    n = x.size
    out = np.empty(n, dtype=np.float32)
    for lo in range(0, n, col_len):
        col = x[lo:lo + col_len]
        pos, neg = col[col >= 0], col[col < 0]
        mp = np.float32(pos.astype(np.float64).sum() / max(pos.size, 1))
        mn = np.float32(neg.astype(np.float64).sum() / max(neg.size, 1))
        out[lo:lo + col_len] = np.where(col >= 0, mp, mn)
    return out


def ref_tern_scale(x, clip):
    if x.size == 0:
        return np.float32(0)
    s = float(np.abs(x).max())
    sigma = float(np.std(x.astype(np.float64)))
    if clip is not None and sigma > 0:
        s = min(s, clip * sigma)
    return np.float32(s)


def ref_mix64(z):
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return z ^ (z >> 31)


@pytest.mark.parametrize("seed,rank,step,salt,want", [
    (0, 0, 0, 0, 0xd1d195d96ff518aa), (1, 3, 12345, 7, 0xd264b4883d3fb505),
    (2**64 - 1, 999, 2**40 + 3, 2**32 - 1, 0xf89d887165adb420), (-5, 0, 1, 13, 0x28f98ee1442e7197),
    (12345678901234567890, 4, 0, 0, 0x17e142202868fd7b), (7, 2**63, 5, 3, 0x1105aa620faa6c5c)])
def test_stream_keys_are_the_documented_mix(seed, rank, step, salt, want):
    """Every stochastic packet's bits hang on ``stream_key`` (the GPU twins
    take the host's key): the documented chain of mixes, and the values it
    gave before its (seed, rank) half was kept between calls -- twice, so the
    kept half is the one used."""
    golden = 0x9E3779B97F4A7C15
    z = ref_mix64(seed + golden)
    for term, k in ((rank, 2), (step, 3), (salt, 5)):
        z = ref_mix64(z ^ ((term + k * golden) & ((1 << 64) - 1)))
    assert z == want
    for _ in range(2):
        got = stream_key(seed, rank, step, salt)
        assert type(got) is np.uint64 and int(got) == want


def ref_tern_codes(x, ctx, shared, own):
    u = uniform_array(stream_key(ctx.seed, ctx.rank, ctx.step, 4), ctx.offset, x.size)
    keep = u * shared < np.minimum(np.abs(x), own)
    return (np.sign(x) * keep).astype(np.int8)


def ref_terngrad(x, ctx, clip=2.5):
    s = ref_tern_scale(x, clip)
    codes = ref_tern_codes(x, ctx, s, s)
    return np.concatenate([ref_header(4, x.size), np.array([s], np.float32).view(np.uint8),
                           pack_lsb_first(codes, 2)])


def ref_qsgd_scales(x, d, norm):
    out = []
    for lo in range(0, x.size, d):
        b = x[lo:lo + d]
        if norm == "max":
            out.append(np.abs(b).max())
        else:
            out.append(np.sqrt(np.sum(b.astype(np.float64) ** 2)))
    return np.array(out, dtype=np.float32)


def ref_qsgd_codes(x, ctx, d, levels, scales):
    u = uniform_array(stream_key(ctx.seed, ctx.rank, ctx.step, 5), ctx.offset, x.size)
    codes = np.zeros(x.size, dtype=np.int64)
    for j, lo in enumerate(range(0, x.size, d)):
        s = scales[j]
        if not (s > 0 and np.isfinite(s)):
            continue
        a = np.abs(x[lo:lo + d].astype(np.float64)) * (levels / np.float64(s))
        q = np.minimum(np.floor(a + u[lo:lo + d].astype(np.float64)), levels).astype(np.int64)
        codes[lo:lo + d] = np.where(x[lo:lo + d] < 0, -q, q)
    return codes


def ref_qsgd(x, ctx, bits=4, bucket=512, norm="l2"):
    n = x.size
    d = min(bucket, max(n, 1))
    levels = 2 ** (bits - 1) - 1
    scales = ref_qsgd_scales(x, d, norm)
    codes = ref_qsgd_codes(x, ctx, d, levels, scales)
    return np.concatenate([ref_header(5, n, d | bits << 28), scales.view(np.uint8),
                           pack_lsb_first(codes, bits)])


def ref_codes_decode(codes, scales, d, levels):
    unit = np.repeat(scales.astype(np.float64) / levels, d)[:codes.size]
    return (codes * unit).astype(np.float32)


def reference(name, params, x, ctx):
    if name == "fp16":
        return ref_fp16(x)
    if name == "bf16":
        return ref_bf16(x)
    if name == "onebit":
        return ref_onebit(x, params.get("col_len") or min(max(x.size, 1), VECTOR_COLUMN))
    if name == "terngrad":
        return ref_terngrad(x, ctx, params.get("clip", 2.5))
    return ref_qsgd(x, ctx, **params)


def formula(name, params, n):
    """Wire sizes as documented in the module docstrings."""
    if name in ("fp16", "bf16"):
        return 16 + 2 * n
    if name == "onebit":
        H = params.get("col_len") or min(max(n, 1), VECTOR_COLUMN)
        return 16 + 8 * math.ceil(n / H) + 4 * math.ceil(n / 32)
    if name == "terngrad":
        return 20 + math.ceil(n / 4)
    d, b = min(params.get("bucket", 512), max(n, 1)), params.get("bits", 4)
    return 16 + 4 * math.ceil(n / d) + math.ceil(n * b / 8)


# ---------------------------------------------------------------------------
# packets against the references
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("n", SIZES)
def test_packet_matches_reference(name, params, n):
    codec = make(name, params)
    x = data(n)
    ctx = EncodeContext(CTX.seed, CTX.rank, CTX.step, CTX.offset, shape=(n,))
    packet = codec.encode(x, ctx)
    np.testing.assert_array_equal(packet, reference(name, params, x, ctx))
    assert packet.size == formula(name, params, n)
    size = codec.wire_size(n) if codec.fixed_size else codec.wire_size(n, (n,))
    assert size == packet.size <= codec.max_wire_size(n)


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("n", [0, 33, 4097])
def test_decode_and_decode_add(name, params, n):
    codec = make(name, params)
    x = data(n, seed=1)
    packet = codec.encode(x, CTX)
    y = decode(codec, packet, n)
    if name == "fp16":
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    elif name == "onebit":
        np.testing.assert_array_equal(y, ref_onebit_decode(
            x, params.get("col_len") or min(max(n, 1), VECTOR_COLUMN)))
    elif name in ("terngrad", "qsgd"):
        bits = params.get("bits", 2 if name == "terngrad" else 4)
        levels = 2 ** (bits - 1) - 1
        hdr = packet[:HEADER_SIZE].view(HEADER)[0]
        d = int(hdr["extra"]) & (2**28 - 1) if name == "qsgd" else max(n, 1)
        nb = math.ceil(n / d)
        scales = packet[16:16 + 4 * nb].view(np.float32)
        codes = unpack_lsb_first(packet[16 + 4 * nb:], bits, n)
        np.testing.assert_array_equal(y, ref_codes_decode(codes, scales, d, levels))
    base = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    acc = base.copy()
    codec.decode_add(packet, acc)
    np.testing.assert_array_equal(acc, base + y)


def test_ids_flags_and_params():
    expect = {"fp16": 1, "bf16": 2, "onebit": 3, "terngrad": 4, "qsgd": 5}
    for name, cid in expect.items():
        c = hpccomm.get_codec(name)
        assert c.codec_id == cid and c.name == name and name in hpccomm.available_codecs()
    assert hpccomm.get_codec("onebit").biased and not hpccomm.get_codec("qsgd").biased
    assert hpccomm.get_codec("terngrad").summable and hpccomm.get_codec("qsgd").summable
    assert hpccomm.get_codec("terngrad").stochastic and hpccomm.get_codec("qsgd").stochastic
    assert not hpccomm.get_codec("fp16").summable and not hpccomm.get_codec("onebit").summable
    assert hpccomm.get_codec("qsgd", bits=2, bucket=64).params() == {
        "bits": 2, "bucket": 64, "norm": "l2"}
    assert hpccomm.get_codec("terngrad", clip=None).params() == {"clip": None}
    assert hpccomm.get_codec("onebit", col_len=5).describe() == "onebit(col_len=5)"
    assert not hpccomm.get_codec("onebit").fixed_size
    assert hpccomm.get_codec("onebit", col_len=5).fixed_size


@pytest.mark.parametrize("name,params", [
    ("onebit", {"col_len": 0}), ("onebit", {"col_len": 2.5}), ("onebit", {"col_len": 2**32}),
    ("terngrad", {"clip": 0}), ("terngrad", {"clip": -1.0}), ("terngrad", {"clip": math.inf}),
    ("qsgd", {"bits": 3}), ("qsgd", {"bits": True}), ("qsgd", {"bucket": 0}),
    ("qsgd", {"bucket": 2**28}), ("qsgd", {"norm": "l1"}), ("fp16", {"nonfinite": "ignore"}),
])
def test_bad_parameters(name, params):
    with pytest.raises(ValueError):
        hpccomm.get_codec(name, **params)


# ---------------------------------------------------------------------------
# onebit: columns
# ---------------------------------------------------------------------------
def test_onebit_column_length_from_shape_and_align():
    codec = hpccomm.get_codec("onebit")
    x = data(100)
    # 1-D and scalar shapes: VECTOR_COLUMN, clamped to the vector's length
    for shape, H in [((4, 25), 25), ((2, 5, 10), 10), ((100,), 100), ((), 100)]:
        packet = codec.encode(x, EncodeContext(shape=shape))
        assert int(packet[:HEADER_SIZE].view(HEADER)[0]["extra"]) == H
        np.testing.assert_array_equal(packet, ref_onebit(x, H))
        assert codec.align(shape) == (H if len(shape) >= 2 else VECTOR_COLUMN)
        assert codec.wire_size(100, shape) == packet.size
    long = data(3 * VECTOR_COLUMN + 5)
    packet = codec.encode(long, EncodeContext(shape=long.shape))
    np.testing.assert_array_equal(packet, ref_onebit(long, VECTOR_COLUMN))
    assert codec.wire_size(100) is None
    assert codec.max_wire_size(100) == 16 + 8 * 100 + 4 * 4
    fixed = hpccomm.get_codec("onebit", col_len=30)
    assert fixed.align((4, 25)) == 30
    assert int(fixed.encode(x, EncodeContext(shape=(4, 25)))[4:8].view("<u4")[0]) == 30
    # a column longer than the vector is stored clamped
    assert int(fixed.encode(x[:10])[4:8].view("<u4")[0]) == 10


@pytest.mark.parametrize("col_len", [1, 5, 32, 33, 100])
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_onebit_exact_on_constant_columns(col_len, sign):
    n = 4 * col_len + 3
    cols = np.repeat(np.arange(1, n // col_len + 2, dtype=np.float32) * 0.37, col_len)[:n]
    x = (sign * cols).astype(np.float32)
    codec = hpccomm.get_codec("onebit", col_len=col_len)
    np.testing.assert_array_equal(codec.roundtrip(x), x)


def test_onebit_reconstruction_error_bound():
    """Per column, the class means minimise the squared error, so
    ||decode - x|| <= ||x|| column by column."""
    x = data(4097, seed=3)
    codec = hpccomm.get_codec("onebit", col_len=100)
    y = codec.roundtrip(x)
    for lo in range(0, x.size, 100):
        xs, ys = x[lo:lo + 100].astype(np.float64), y[lo:lo + 100]
        assert np.linalg.norm(ys - xs) <= np.linalg.norm(xs) * (1 + 1e-6)
        assert np.all((ys >= 0) == (xs >= 0))


def test_onebit_chunks_at_column_boundaries_match_the_whole():
    x = data(1000, seed=4)
    codec = hpccomm.get_codec("onebit")
    shape = (10, 100)
    whole = decode(codec, codec.encode(x, EncodeContext(shape=shape)), 1000)
    parts = np.empty(1000, dtype=np.float32)
    for lo, hi in [(0, 300), (300, 700), (700, 1000)]:
        p = codec.encode(x[lo:hi], EncodeContext(shape=shape, offset=lo))
        codec.decode(p, parts[lo:hi])
    np.testing.assert_array_equal(parts, whole)


# ---------------------------------------------------------------------------
# fp16 / bf16
# ---------------------------------------------------------------------------
def test_fp16_exact_on_representable_values_and_saturates():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 0x10000, 5000, dtype=np.uint16)
    h = bits.view(np.float16)
    h = h[np.isfinite(h)]
    x = h.astype(np.float32)
    np.testing.assert_array_equal(hpccomm.get_codec("fp16").roundtrip(x), x)
    big = np.array([65504, 65519.99, 65520, 1e6, -1e30, 3e38, 2.0**-25, 2.0**-24 * 1.5],
                   dtype=np.float32)
    np.testing.assert_array_equal(
        hpccomm.get_codec("fp16").roundtrip(big),
        np.array([65504, 65504, 65504, 65504, -65504, 65504, 0, 2.0**-23], dtype=np.float32))


def test_bf16_exact_on_representable_values_and_saturates():
    rng = np.random.default_rng(6)
    x = (rng.integers(0, 0x10000, 5000, dtype=np.uint32) << 16).view(np.float32)
    x = x[np.isfinite(x)]
    np.testing.assert_array_equal(hpccomm.get_codec("bf16").roundtrip(x), x)
    fmax = np.finfo(np.float32).max
    y = hpccomm.get_codec("bf16").roundtrip(np.array([fmax, -fmax, 1.0 + 2.0**-8], np.float32))
    assert y[0] == -y[1] == np.float32(3.3895314e38) and y[2] == 1.0  # tie to even


#: low 16 bits combined with every pattern of the top 16: zero, ones, the
#: halfway points of fp16 normals (bit 12, with the kept low bit 13 clear and
#: set) and of bf16 (bit 15), their neighbours (ties of fp16 subnormals lie
#: at bits 13..23, so zero low bits with the top patterns cover them)
LOW_PATTERNS = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001, 0x7FFF,
                0x8000, 0x8001, 0xFFFF]


def every_top_half():
    top = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    low = np.array(LOW_PATTERNS, dtype=np.uint32)
    return (top[:, None] | low[None, :]).reshape(-1)


def ref_nonfinite_half(u, bf16):
    """Codec bits for inf / NaN patterns ``u``: infinity kept, NaN made quiet
    with the top payload bits kept, the sign kept."""
    a = u & 0x7FFFFFFF
    sign = (u >> 16) & 0x8000
    if bf16:
        return ((u >> 16) | np.where(a > 0x7F800000, 0x40, 0)).astype(np.uint16)
    return (sign | 0x7C00 | ((a >> 13) & 0x3FF) | np.where(a > 0x7F800000, 0x200, 0)).astype(
        np.uint16)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("fused", [False, True])
def test_half_rounding_of_every_top_half_pattern(name, fused):
    """Every float32 whose top 16 bits take all 65536 values, each with a few
    low-bit patterns (ties, their neighbours): the packet equals numpy's
    rounding (fp16: ``astype(float16)``) with saturation for finite values
    and the documented inf / NaN bits; the fused encoder agrees."""
    u = every_top_half()
    x = u.view(np.float32)
    codec = hpccomm.get_codec(name, nonfinite="propagate")
    if fused:
        e_out = np.empty_like(x)
        packet = codec.encode_with_feedback(x, None, e_out, EncodeContext())
    else:
        packet = codec.encode(x)
    got = packet[HEADER_SIZE:].view(np.uint16)
    finite = np.isfinite(x)
    want = (ref_fp16 if name == "fp16" else ref_bf16)(x[finite])[HEADER_SIZE:].view(np.uint16)
    np.testing.assert_array_equal(got[finite], want)
    np.testing.assert_array_equal(got[~finite], ref_nonfinite_half(u[~finite], name == "bf16"))


@pytest.mark.parametrize("add", [False, True])
def test_fp16_decodes_every_pattern(add):
    """All 65536 half patterns decode exactly (numpy's widening); NaN to the
    canonical quiet NaN of its sign."""
    h = np.arange(1 << 16, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    want.view(np.uint32)[nan] = np.where(h[nan] & 0x8000, 0xFFC00000, 0x7FC00000)
    base = np.random.default_rng(2).standard_normal(h.size).astype(np.float32)
    if add:
        want = base + want
    packet = np.concatenate([ref_header(1, h.size), h.view(np.uint8)])
    out = base.copy()
    (hpccomm.get_codec("fp16").decode_add if add else hpccomm.get_codec("fp16").decode)(packet,
                                                                                        out)
    assert out.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("name,rel", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_width_error_bound(name, rel):
    x = data(4097, seed=7)
    y = hpccomm.get_codec(name).roundtrip(x)
    assert np.all(np.abs(y - x) <= rel * np.abs(x) + 2.0**-25)


# ---------------------------------------------------------------------------
# terngrad / qsgd: error bounds, exact cases, unbiasedness
# ---------------------------------------------------------------------------
def test_terngrad_error_bound_and_signs():
    x = data(4097, seed=8)
    codec = hpccomm.get_codec("terngrad")
    y = codec.roundtrip(x, CTX)
    s = ref_tern_scale(x, 2.5)
    assert set(np.unique(y)) <= {-s, 0, s}
    assert np.all(np.abs(y - x) <= np.maximum(s, np.abs(x) - s) * (1 + 1e-6))
    assert np.all((y == 0) | (np.sign(y) == np.sign(x)))
    assert np.abs(x).max() > s  # clipping was active


def test_terngrad_constant_input_is_exact():
    codec = hpccomm.get_codec("terngrad")
    for c in (-0.75, 3.0):
        x = np.full(1001, c, dtype=np.float32)
        np.testing.assert_array_equal(codec.roundtrip(x, CTX), x)
    np.testing.assert_array_equal(codec.roundtrip(np.array([-2.5], np.float32)), [-2.5])


@pytest.mark.parametrize("bits,norm", [(2, "l2"), (4, "l2"), (4, "max"), (8, "max")])
def test_qsgd_error_bound_and_exact_maxima(bits, norm):
    x = data(4097, seed=9)
    d, levels = 64, 2 ** (bits - 1) - 1
    codec = hpccomm.get_codec("qsgd", bits=bits, bucket=d, norm=norm)
    y = codec.roundtrip(x, CTX)
    scales = ref_qsgd_scales(x, d, norm)
    step = np.repeat(scales.astype(np.float64) / levels, d)[:x.size]
    assert np.all(np.abs(y - x) <= step * (1 + 1e-6))
    assert np.all((y == 0) | (np.sign(y) == np.sign(x)))
    if norm == "max":  # the bucket maximum decodes exactly to +-scale
        for j in range(scales.size):
            i = j * d + int(np.argmax(np.abs(x[j * d:(j + 1) * d])))
            assert y[i] == x[i]


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_zeros_decode_to_exact_zeros(name, params):
    codec = make(name, params)
    for n in (1, 33, 4097):
        with np.errstate(all="raise"):
            y = codec.roundtrip(np.zeros(n, np.float32), CTX)
        np.testing.assert_array_equal(y, np.zeros(n, np.float32))


def _mean_over_steps(codec, x, steps):
    acc = np.zeros(x.size, dtype=np.float64)
    out = np.empty(x.size, dtype=np.float32)
    for t in range(steps):
        acc += codec.decode(codec.encode(x, EncodeContext(seed=1, rank=2, step=t)), out)
    return acc / steps


@pytest.mark.parametrize("name,params", [
    ("terngrad", {"clip": None}), ("qsgd", {"bits": 2, "bucket": 50}),
    ("qsgd", {"bits": 4, "bucket": 512}), ("qsgd", {"bits": 4, "bucket": 64, "norm": "max"})])
def test_unbiased(name, params):
    """The mean over T steps (independent draws) of decode(encode(x)) is x:
    the total and the sign-weighted total deviation stay within 5 standard
    errors (variances known exactly: s|x| - x^2 for TernGrad, unit^2 f (1 - f)
    for QSGD with f the fractional level)."""
    x = data(1000, seed=10)
    T = 300
    codec = make(name, params)
    mean = _mean_over_steps(codec, x, T)
    x64 = x.astype(np.float64)
    if name == "terngrad":
        s = float(np.abs(x).max())
        var = s * np.abs(x64) - x64 ** 2
    else:
        d, levels = params["bucket"], 2 ** (params["bits"] - 1) - 1
        scales = ref_qsgd_scales(x, d, params.get("norm", "l2")).astype(np.float64)
        unit = np.repeat(scales / levels, d)[:x.size]
        a = np.abs(x64) / unit
        f = a - np.floor(a)
        var = unit ** 2 * f * (1 - f)
    se = math.sqrt(var.sum() / T)
    dev = mean - x64
    assert abs(dev.sum()) <= 5 * se, (dev.sum(), se)
    assert abs((np.sign(x64) * dev).sum()) <= 5 * se, ((np.sign(x64) * dev).sum(), se)


def test_stochastic_draws_depend_on_rank_step_seed_only():
    x = data(1000, seed=11)
    for name in ("terngrad", "qsgd"):
        codec = hpccomm.get_codec(name)
        a = codec.encode(x, EncodeContext(seed=1, rank=0, step=0))
        assert np.array_equal(a, codec.encode(x, EncodeContext(seed=1, rank=0, step=0)))
        for ctx in (EncodeContext(seed=2), EncodeContext(seed=1, rank=1),
                    EncodeContext(seed=1, step=1)):
            assert not np.array_equal(a, codec.encode(x, ctx))


def test_qsgd_chunks_at_bucket_boundaries_match_the_whole():
    """Element i draws uniform01(key, offset + i): encoding a chunk at its
    global offset gives the whole vector's codes and scales."""
    x = data(4096, seed=12)
    codec = hpccomm.get_codec("qsgd", bits=4, bucket=64)
    ctx = EncodeContext(seed=3, rank=1, step=2)
    whole = codec.encode(x, ctx)
    nb = 4096 // 64
    for lo, hi in [(0, 1024), (1024, 2048 + 512), (2048 + 512, 4096)]:
        part = codec.encode(x[lo:hi], EncodeContext(3, 1, 2, lo))
        k = (hi - lo) // 64
        np.testing.assert_array_equal(part[16:16 + 4 * k], whole[16 + 4 * (lo // 64):][:4 * k])
        np.testing.assert_array_equal(part[16 + 4 * k:],
                                      whole[16 + 4 * nb + lo // 2:16 + 4 * nb + hi // 2])


# ---------------------------------------------------------------------------
# summable form
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", [("terngrad", {}), ("terngrad", {"clip": None}),
                                         ("qsgd", {"bits": 4, "bucket": 33}),
                                         ("qsgd", {"bits": 8, "bucket": 100, "norm": "max"})])
@pytest.mark.parametrize("n", [0, 1, 100, 4097])
def test_summable_form(name, params, n):
    codec = make(name, params)
    P = 3
    xs = [data(n, seed=20 + r) * (r + 1) for r in range(P)]
    ctxs = [EncodeContext(seed=4, rank=r, step=1) for r in range(P)]
    scales = [codec.shared_scale(x) for x in xs]
    shared = np.max(scales, axis=0).astype(np.float32)
    # a single rank: the summable codes decode exactly like a packet
    own = codec.from_summable(codec.to_summable(xs[0], scales[0], ctxs[0]), scales[0],
                              np.empty(n, np.float32))
    np.testing.assert_array_equal(own, codec.roundtrip(xs[0], ctxs[0]))
    dt = codec.summable_dtype(P)
    total = np.zeros(n, dtype=dt)
    for x, ctx in zip(xs, ctxs):
        codes = codec.to_summable(x, shared, ctx)
        assert codes.dtype == np.int8 and codes.size == n
        if name == "terngrad":
            ref = ref_tern_codes(x, ctx, shared[0], ref_tern_scale(x, params.get("clip", 2.5)))
            levels, d = 1, max(n, 1)
        else:
            d, levels = params["bucket"], 2 ** (params["bits"] - 1) - 1
            ref = ref_qsgd_codes(x, ctx, d, levels, shared)
        np.testing.assert_array_equal(codes, ref)
        assert np.all(np.abs(codes.astype(int)) <= levels)
        total += codes.astype(dt)
    out = codec.from_summable(total, shared, np.empty(n, np.float32))
    np.testing.assert_array_equal(out, ref_codes_decode(total.astype(np.int64), shared, d,
                                                        levels))
    acc = np.ones(n, np.float32)
    codec.from_summable(total, shared, acc, add=True)
    np.testing.assert_array_equal(acc, np.float32(1) + out)


def test_summable_dtypes_and_argument_checks():
    t = hpccomm.get_codec("terngrad")
    assert [t.summable_dtype(p) for p in (1, 127, 128, 32767, 32768)] == \
        [np.int8, np.int8, np.int16, np.int16, np.int32]
    q4 = hpccomm.get_codec("qsgd", bits=4)
    assert [q4.summable_dtype(p) for p in (18, 19, 4681, 4682)] == \
        [np.int8, np.int16, np.int16, np.int32]
    q8 = hpccomm.get_codec("qsgd", bits=8)
    assert [q8.summable_dtype(p) for p in (1, 2, 258, 259)] == \
        [np.int8, np.int16, np.int16, np.int32]
    q = hpccomm.get_codec("qsgd", bucket=10)
    x = data(100)
    with pytest.raises(ValueError, match="shared scale"):
        q.to_summable(x, np.ones(9, np.float32), CTX)
    with pytest.raises(ValueError, match="shared scale"):
        t.from_summable(np.zeros(100, np.int8), np.ones(2, np.float32), np.empty(100, np.float32))
    with pytest.raises(ValueError, match="summed codes"):
        q.from_summable(np.zeros(99, np.int8), np.ones(10, np.float32), np.empty(100, np.float32))
    with pytest.raises(TypeError):
        q.from_summable(np.zeros(100, np.float32), np.ones(10, np.float32),
                        np.empty(100, np.float32))


# ---------------------------------------------------------------------------
# input checks, non-finite values, float16-valued input
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input(name, params, bad):
    x = data(100)
    x[17] = bad
    with pytest.raises(NonFiniteError):
        make(name, params).encode(x, CTX)
    if make(name, params).summable:
        with pytest.raises(NonFiniteError):
            make(name, params).shared_scale(x)
    y = make(name, params, nonfinite="propagate").roundtrip(x, CTX)
    assert not np.isfinite(y[17])
    if np.isnan(bad):
        assert np.isnan(y[17])
    elif name in ("fp16", "bf16"):
        assert y[17] == bad and np.all(np.isfinite(np.delete(y, 17)))


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_float16_valued_input(name, params):
    x = data(1000, seed=13).astype(np.float16).astype(np.float32)
    codec = make(name, params)
    np.testing.assert_array_equal(codec.encode(x, CTX), reference(name, params, x, CTX))
    if name == "fp16":
        np.testing.assert_array_equal(codec.roundtrip(x), x)


def test_input_type_checks():
    codec = hpccomm.get_codec("qsgd")
    with pytest.raises(TypeError, match="float32"):
        codec.encode(np.zeros(4, np.float64))
    with pytest.raises(TypeError, match="numpy"):
        codec.encode([0.0, 1.0])
    # multi-dimensional input is flattened
    x = data(60).reshape(6, 10)
    np.testing.assert_array_equal(codec.encode(x, CTX), codec.encode(x.reshape(-1), CTX))


# ---------------------------------------------------------------------------
# corrupt packets
# ---------------------------------------------------------------------------
GUARD = 16
SENTINEL = np.float32(-12345.5)


def guarded_decode(codec, packet, n, add=False):
    """Decode into the middle of a larger buffer and check that nothing
    outside ``out`` was written (numba kernels do no bounds checks)."""
    buf = np.full(n + 2 * GUARD, SENTINEL, dtype=np.float32)
    out = buf[GUARD:GUARD + n]
    try:
        (codec.decode_add if add else codec.decode)(packet, out)
    finally:
        assert np.all(buf[:GUARD] == SENTINEL) and np.all(buf[GUARD + n:] == SENTINEL)
    return out


def _corrupt_cases():
    return st.tuples(st.sampled_from(range(len(VARIANTS))),
                     st.sampled_from([0, 1, 7, 33, 100, 257]),
                     st.sampled_from(["truncate", "extend", "header", "payload", "codec"]),
                     st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=24),
                     st.booleans())


@settings(max_examples=200, deadline=None)
@given(_corrupt_cases())
def test_corrupt_packets_raise_or_decode_safely(case):
    vi, n, how, pos, blob, add = case
    name, params = VARIANTS[vi]
    codec = make(name, params, nonfinite="propagate")
    packet = codec.encode(data(n, seed=14), EncodeContext(shape=(n,))).copy()
    if how == "truncate":
        packet = packet[:pos % packet.size]
    elif how == "extend":
        packet = np.concatenate([packet, np.frombuffer(blob, dtype=np.uint8)])
    elif how == "header":
        for k, b in enumerate(blob[:4]):
            packet[(pos + 3 * k) % HEADER_SIZE] = b
    elif how == "payload":
        if packet.size > HEADER_SIZE:
            for k, b in enumerate(blob):
                packet[HEADER_SIZE + (pos + 7 * k) % (packet.size - HEADER_SIZE)] = b
    else:
        packet[3] = (int(packet[3]) + 1 + pos % 250) % 256
    try:
        guarded_decode(codec, packet, n, add)
    except PacketError:
        assert how != "payload"


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_header_field_and_length_checks(name, params):
    codec = make(name, params)
    x = data(100)
    packet = codec.encode(x, EncodeContext(shape=(100,)))
    with pytest.raises(PacketError, match="holds 100 elements"):
        codec.decode(packet, np.empty(99, np.float32))
    with pytest.raises(TypeError):
        codec.decode(packet, np.empty(100, np.float64))
    with pytest.raises(PacketError):
        codec.decode(packet.view(np.int8), np.empty(100, np.float32))
    other = hpccomm.get_codec("none").encode(x)
    with pytest.raises(PacketError, match="codec id"):
        codec.decode(other, np.empty(100, np.float32))
    bad = packet.copy()
    bad[2] = 2  # format version
    with pytest.raises(PacketError, match="version"):
        codec.decode(bad, np.empty(100, np.float32))
    extra = packet[:HEADER_SIZE].view(HEADER)[0]["extra"]
    bad_extras = {"fp16": [1], "bf16": [7], "terngrad": [1], "onebit": [0, 101, 2**32 - 1],
                  "qsgd": [0, int(extra) & (2**28 - 1), 3 << 28 | 10, 8 << 28 | 101,
                           15 << 28 | 50]}[name]
    for value in bad_extras:
        bad = packet.copy()
        bad[4:8].view("<u4")[0] = value
        with pytest.raises(PacketError):
            codec.decode(bad, np.empty(100, np.float32))


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_unaligned_packets_decode_alike(name, params):
    """Packets received by MPI sit at any byte offset of a receive buffer."""
    codec = make(name, params)
    packet = codec.encode(data(1000, seed=15), CTX)
    buf = np.zeros(packet.size + 3, dtype=np.uint8)
    buf[3:] = packet
    np.testing.assert_array_equal(decode(codec, buf[3:], 1000), decode(codec, packet, 1000))


FUSED = [("onebit", {}), ("onebit", {"col_len": 7}), ("onebit", {"col_len": 4097}),
         ("onebit", {"col_len": 1 << 16}), ("fp16", {}), ("bf16", {}),
         ("fp8", {}), ("fp8", {"format": "e5m2", "block": 256}),
         ("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.3, "exact": True}),
         ("dgc", {"ratio": 0.01}),
         ("threshold", {}), ("threshold", {"tau": 0.5}),
         ("threshold", {"alpha": 0.5, "max_ratio": 0.01}),   # the cap cuts
         ("adaptive", {}), ("adaptive", {"proportion": 4, "col_len": 100}),
         ("adaptive", {"proportion": 2, "col_len": 37, "excess": 1}),   # sides cut to cap
         ("adaptive", {"col_len": 1 << 16}),
         ("terngrad", {}), ("terngrad", {"clip": None}),
         ("qsgd", {}), ("qsgd", {"bits": 2, "bucket": 512, "norm": "max"}),
         ("qsgd", {"bits": 8, "bucket": 100}), ("qsgd", {"bits": 2, "bucket": 7}),
         ("qsgd", {"bits": 4, "bucket": 7, "norm": "max"}),
         ("qsgd", {"bits": 8, "bucket": 5000, "norm": "max"}),
         ("qsgd", {"rotate": True, "norm": "max"}), ("onebit", {"rotate": True, "rotate_block": 64}),
         ("fp8", {"rotate": True, "rotate_block": 2}),
         ("qsgd", {"elias": True}), ("qsgd", {"bits": 2, "bucket": 7, "elias": True}),
         ("qsgd", {"elias": True, "rotate": True}),
         ("randk", {}), ("randk", {"ratio": 0.3, "unbiased": False}), ("randk", {"ratio": 1.0})]


@pytest.mark.parametrize("n", [0, 1, 31, 33, 1000, 4097 * 3 + 5, 70_001])
@pytest.mark.parametrize("name,params", FUSED)
@pytest.mark.parametrize("has_e", [False, True])
def test_encode_with_feedback_is_encode_decode_subtract(name, params, n, has_e):
    """Every fused kernel against the three steps it replaces, bit for bit
    (packet and new residual): zeros of both signs, subnormals, values beyond
    fp16's range (saturated) included.  The encode sees ``x`` as the fresh
    part (threshold's ``alpha``); with a residual, under ``feedback`` (the
    unbiased codecs' contracted form)."""
    codec = hpccomm.get_codec(name, **params)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-40, -1e-40, 7e4, -1e5, 3.4e38, 6e-8], np.float32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    e = rng.standard_normal(n).astype(np.float32) * np.float32(0.1) if has_e else None
    if has_e and n > 10:
        e[8:10] = (-0.0, 0.0)
    ctx = EncodeContext(shape=(n,), feedback=has_e)
    e_out = np.full(n, np.nan, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, ctx)
    v = x + e if has_e else x.copy()
    want = codec.encode(v, replace(ctx, fresh=x))
    want_e = v - codec.decode(want, np.empty(n, np.float32))
    assert packet.tobytes() == want.tobytes()
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


@pytest.mark.parametrize("name,params", [("terngrad", {}), ("terngrad", {"clip": None}),
                                         ("qsgd", {}), ("qsgd", {"bits": 2, "bucket": 7}),
                                         ("randk", {"ratio": 0.1})])
@pytest.mark.parametrize("n", [0, 1, 33, 4097 * 3 + 5])
@pytest.mark.parametrize("has_e", [False, True])
def test_stochastic_fused_kernels_draw_with_the_context(name, params, n, has_e):
    """The fused kernels of the stochastic codecs at a nonzero seed, rank,
    step and offset: the same draws as encode."""
    codec = hpccomm.get_codec(name, **params)
    rng = np.random.default_rng(n + 1)
    x = rng.standard_normal(n).astype(np.float32)
    e = rng.standard_normal(n).astype(np.float32) * np.float32(0.3) if has_e else None
    ctx = EncodeContext(seed=9, rank=4, step=6, offset=1001, shape=(n,), feedback=has_e)
    e_out = np.full(n, np.nan, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, ctx)
    v = x + e if has_e else x.copy()
    want = codec.encode(v, ctx)
    assert packet.tobytes() == want.tobytes()
    want_e = v - codec.decode(want, np.empty(n, np.float32))
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


def _contraction(codec, x, ctx):
    """``||decode(encode(x)) - x||**2 / ||x||**2``."""
    out = codec.decode(codec.encode(x, ctx), np.empty(x.size, np.float32))
    d = out.astype(np.float64) - x
    return float(d @ d / (x.astype(np.float64) @ x))


@pytest.mark.parametrize("params", [{}, {"bits": 2, "bucket": 7}, {"bits": 8, "bucket": 100},
                                    {"bits": 4, "bucket": 64, "norm": "max"}])
@pytest.mark.parametrize("n", [1, 33, 1000, 4097 * 3 + 5])
def test_qsgd_under_feedback_stores_contracted_scales(params, n):
    """Under ``feedback`` the codes are those of the plain encode and bucket
    ``j`` stores ``float32(S_j / (1 + omega_j))``, ``omega_j`` the smaller of
    ``min(d / L**2, sqrt(d) / L)`` of its own length ``d`` and ``S_j
    ||x_j||_1 / (L ||x_j||**2)``; the rest is unchanged."""
    codec = hpccomm.get_codec("qsgd", **params)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    ctx = EncodeContext(seed=3, rank=1, step=2, offset=5)
    plain = codec.encode(x, ctx)
    fed = codec.encode(x, replace(ctx, feedback=True))
    bucket = min(codec.bucket, n)
    nb = -(-n // bucket)
    L = codec.levels
    lens = np.array([min(bucket, n - j * bucket) for j in range(nb)], np.float64)
    S = plain[HEADER_SIZE:HEADER_SIZE + 4 * nb].view(np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    l1 = np.array([np.abs(x64[j * bucket:(j + 1) * bucket]).sum() for j in range(nb)])
    l2 = np.array([(x64[j * bucket:(j + 1) * bucket] ** 2).sum() for j in range(nb)])
    omega = np.minimum(np.minimum(lens / L ** 2, np.sqrt(lens) / L), S * l1 / (L * l2))
    want = S / (1.0 + omega)
    got = fed[HEADER_SIZE:HEADER_SIZE + 4 * nb].view(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert fed[HEADER_SIZE + 4 * nb:].tobytes() == plain[HEADER_SIZE + 4 * nb:].tobytes()
    assert fed[:HEADER_SIZE].tobytes() == plain[:HEADER_SIZE].tobytes()


@pytest.mark.parametrize("clip", [2.5, None])
@pytest.mark.parametrize("n", [1, 33, 1000, 4097 * 3 + 5])
def test_terngrad_under_feedback_stores_the_contracted_scale(clip, n):
    """Under ``feedback`` ``clip`` does not apply: the codes are those of
    the plain unclipped encode (scale ``s = max|v|``), and the packet's scale
    is ``float32(s ||v||**2 / (max|v| ||v||_1))``; all zeros keep ``s``."""
    codec = hpccomm.get_codec("terngrad", clip=clip)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    ctx = EncodeContext(seed=3, rank=1, step=2)
    plain = hpccomm.get_codec("terngrad", clip=None).encode(x, ctx)
    fed = codec.encode(x, replace(ctx, feedback=True))
    s = float(plain[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0])
    x64 = x.astype(np.float64)
    assert s == np.abs(x64).max()
    a = (x64 @ x64) / (s * np.abs(x64).sum())
    got = float(fed[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0])
    assert got == pytest.approx(s * a, rel=1e-6) and got <= s
    assert fed[HEADER_SIZE + 4:].tobytes() == plain[HEADER_SIZE + 4:].tobytes()
    zeros = np.zeros(n, np.float32)
    assert codec.encode(zeros, replace(ctx, feedback=True)).tobytes() == \
        codec.encode(zeros, ctx).tobytes()


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("qsgd", {"bits": 2, "bucket": 7}),
                                         ("terngrad", {}), ("terngrad", {"clip": None}),
                                         ("randk", {"ratio": 0.05})])
def test_feedback_form_is_contractive(name, params):
    """The decoded value under ``feedback`` is contractive on average,
    ``E||C(x) - x||**2 < ||x||**2`` (what error feedback needs) -- for QSGD
    within its bound ``omega / (1 + omega)`` -- where the plain unbiased
    forms of terngrad and randk are not; on heavy-tailed input too."""
    codec = hpccomm.get_codec(name, **params)
    rng = np.random.default_rng(1)
    bound = 0.99
    if name == "qsgd":
        omega = codec.omega(codec.bucket)
        bound = omega / (1 + omega)
    for x in (rng.standard_normal(5000).astype(np.float32),
              rng.standard_t(2, 5000).astype(np.float32)):
        fed = np.mean([_contraction(codec, x, EncodeContext(seed=s, step=s, feedback=True))
                       for s in range(8)])
        plain = np.mean([_contraction(codec, x, EncodeContext(seed=s, step=s))
                         for s in range(8)])
        assert fed < bound, (fed, plain)
        if name != "qsgd":
            assert plain > 1.0, (fed, plain)


@pytest.mark.parametrize("name", ["onebit", "fp16", "bf16", "fp8", "topk", "dgc", "threshold",
                                  "adaptive", "terngrad", "qsgd", "qsgd+rotate", "randk"])
@pytest.mark.parametrize("where", ["x", "x + e"])
def test_encode_with_feedback_raises_on_nonfinite_and_keeps_the_residual(name, where):
    """An infinity in ``x``, or a finite ``x`` and ``e`` whose sum
    overflows: the count is of ``v = x + e``."""
    x = np.arange(10, dtype=np.float32)
    e = np.ones(10, np.float32)
    if where == "x":
        x[7] = np.inf
    else:
        x[7] = e[7] = np.float32(3e38)
    with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
        hpccomm.get_codec(name).encode_with_feedback(x, e, np.empty(10, np.float32),
                                                     EncodeContext())
    assert e[7] == (1 if where == "x" else np.float32(3e38))
    out = np.empty(10, np.float32)
    hpccomm.get_codec(name, nonfinite="propagate").encode_with_feedback(x, e, out,
                                                                        EncodeContext())


@pytest.mark.parametrize("name,params", FUSED)
def test_encode_with_feedback_propagates_like_the_three_steps(name, params):
    """``nonfinite="propagate"``: infinities and NaN in ``v`` give the packet
    and residual bits of encode, decode and subtract too."""
    codec = hpccomm.get_codec(name, nonfinite="propagate", **params)
    rng = np.random.default_rng(3)
    n = 300
    x = rng.standard_normal(n).astype(np.float32)
    x[[5, 50, 250]] = np.inf
    x[[7, 120]] = -np.inf
    x[[9, 200]] = np.nan
    e = rng.standard_normal(n).astype(np.float32)
    ctx = EncodeContext(shape=(n,))
    e_out = np.empty(n, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, ctx)
    v = x + e
    want = codec.encode(v, ctx)
    with np.errstate(invalid="ignore"):
        want_e = v - codec.decode(want, np.empty(n, np.float32))
    assert packet.tobytes() == want.tobytes()
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


def test_codecs_skip_their_scan_only_when_the_caller_checked_the_input():
    """``EncodeContext(finite=True)``: the reducer scanned this very data, so
    the codec does not scan again; the reducer sets it only when it scanned
    (check="always"), so with check="first" a NaN in a later call is still
    caught -- by the codec."""
    from mpi4py import MPI

    x = data(100)
    x[5] = np.nan
    codec = hpccomm.get_codec("bf16")
    with pytest.raises(NonFiniteError):
        codec.encode(x, EncodeContext())
    codec.encode(x, EncodeContext(finite=True))        # trusted: no scan
    clean = data(100)
    for check, who in (("always", "input holds 1 NaN/Inf value(s); codec 'bf16'"),
                       ("first", "bf16: input holds 1 NaN/Inf")):
        reducer = hpccomm.Allreducer(MPI.COMM_SELF, codec="bf16", algorithm="twoshot",
                                     check=check)
        reducer(clean, key="k")
        with pytest.raises(NonFiniteError, match=re.escape(who)):
            reducer(x, key="k")


#: codecs with a fused owner stage (``owner_step``), with layout variants
OWNER = [("onebit", {}), ("onebit", {"col_len": 7}), ("fp16", {}), ("bf16", {}),
         ("fp8", {}), ("fp8", {"format": "e5m2", "block": 64}),
         ("terngrad", {}), ("terngrad", {"clip": None}),
         ("qsgd", {}), ("qsgd", {"bits": 2, "bucket": 7}),
         ("qsgd", {"bits": 8, "bucket": 100, "norm": "max"}),
         ("qsgd", {"bits": 4, "bucket": 5000}),
         ("qsgd", {"bits": 2, "bucket": 7, "rotate": True, "rotate_block": 4}),
         ("onebit", {"rotate": True, "rotate_block": 8}),
         ("qsgd", {"bits": 2, "bucket": 7, "elias": True}),
         ("adaptive", {}), ("adaptive", {"proportion": 4, "col_len": 7}),
         ("randk", {}), ("randk", {"ratio": 0.3, "unbiased": False})]


def owner_reference(codec, received, e, m, ctx):
    """twoshot's owner stage without ``owner_step``: decode-add the packets
    in rank order into zeros, ``w = acc + e`` (the residual memory's
    compensate), re-encode, decode, ``e_out = w - decoded``."""
    acc = np.zeros(m, np.float32)
    for packet in received:
        codec.decode_add(packet, acc)
    w = acc + e if e is not None else acc.copy()
    packet = codec.reencode(w, ctx)
    out = codec.decode(packet, np.empty(m, np.float32))
    with np.errstate(invalid="ignore"):
        return packet, out, w - out


def owner_inputs(name, params, P, m, seed, bad=None):
    """``P`` packets of chunk ``[5, 5 + m)`` as ranks ``0 .. P - 1`` encode
    it, once as separate arrays and once as equal slots of one receive
    buffer (as the all-to-all delivers them: a strided view reaches the
    kernel), and an owner residual."""
    codec = hpccomm.get_codec(name, **params, nonfinite="propagate")
    rng = np.random.default_rng(seed)
    shape = (m + 9,)
    packets = []
    for r in range(P):
        x = rng.standard_normal(m).astype(np.float32) * np.float32(r + 1)
        if m > 6:
            x[:3] = (0.0, -0.0, 1e-40)
        packets.append(codec.encode(x, EncodeContext(seed=2, rank=r, step=7, offset=5,
                                                     shape=shape)))
    size = max(p.size for p in packets) + 3
    buf = np.zeros(P * size, np.uint8)
    slots = []
    for r, p in enumerate(packets):
        buf[r * size:r * size + p.size] = p
        slots.append(buf[r * size:r * size + p.size])
    e = rng.standard_normal(m).astype(np.float32) * np.float32(0.1)
    if m > 8:
        e[6:8] = (-0.0, 0.0)
    if bad is not None and m:
        e[m // 2] = bad
    ctx = EncodeContext(seed=2, rank=P + 1, step=7, offset=5, shape=shape)
    return packets, slots, e, ctx


@pytest.mark.parametrize("name,params", OWNER)
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("m", [0, 1, 33, 4097 * 3 + 5])
@pytest.mark.parametrize("mode", ["feedback", "first", "none"])
def test_owner_step_gives_the_bits_of_the_separate_steps(name, params, P, m, mode):
    """``owner_step(received, e, e_out, out, ctx)``: the packet, ``out`` and
    the owner residual ``e_out`` bit for bit as decode-add, compensate,
    re-encode, decode and subtract -- with a residual, before the first one
    (``e=None``), and without an owner residual (``e_out=None``); received
    packets as arrays and as a strided view of one buffer."""
    codec = hpccomm.get_codec(name, **params)
    packets, slots, e, ctx = owner_inputs(name, params, P, m, seed=m + P)
    e = None if mode != "feedback" else e
    want_packet, want_out, want_e = owner_reference(codec, packets, e, m, ctx)
    for received in (packets, slots):
        out = np.full(m, np.nan, np.float32)
        e_out = None if mode == "none" else np.full(m, np.nan, np.float32)
        packet = codec.owner_step(received, e, e_out, out, ctx)
        assert packet.tobytes() == want_packet.tobytes()
        assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist()
        if e_out is not None:
            assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


@pytest.mark.parametrize("name,params", OWNER)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_owner_step_nonfinite(name, params, bad):
    """A non-finite ``w`` raises with the count under ``nonfinite="raise"``
    and propagates with the bits of the separate steps otherwise."""
    m = 1000
    packets, _, e, ctx = owner_inputs(name, params, 2, m, seed=3, bad=bad)
    with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
        hpccomm.get_codec(name, **params).owner_step(packets, e, np.empty(m, np.float32),
                                                     np.empty(m, np.float32), ctx)
    codec = hpccomm.get_codec(name, **params, nonfinite="propagate")
    want_packet, want_out, want_e = owner_reference(codec, packets, e, m, ctx)
    out, e_out = np.empty(m, np.float32), np.empty(m, np.float32)
    packet = codec.owner_step(packets, e, e_out, out, ctx)
    assert packet.tobytes() == want_packet.tobytes()
    assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist()
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


def test_qsgd_owner_step_takes_the_fields_from_the_packets():
    """The received packets decode with their own bit width and bucket (here
    not the owner's); packets of one chunk that disagree are rejected."""
    m = 3000
    owner = hpccomm.get_codec("qsgd", bits=4, bucket=512)
    packets, _, e, ctx = owner_inputs("qsgd", {"bits": 2, "bucket": 100}, 3, m, seed=4)
    want_packet, want_out, want_e = owner_reference(owner, packets, e, m, ctx)
    out, e_out = np.empty(m, np.float32), np.empty(m, np.float32)
    assert owner.owner_step(packets, e, e_out, out, ctx).tobytes() == want_packet.tobytes()
    assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist()
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()
    other, _, _, _ = owner_inputs("qsgd", {"bits": 2, "bucket": 50}, 1, m, seed=4)
    with pytest.raises(PacketError, match="packets of one chunk"):
        owner.owner_step(packets[:2] + other, e, e_out, out, ctx)
    with pytest.raises(PacketError, match="holds 3000 elements"):
        owner.owner_step(packets, e[:-1], e_out[:-1], out[:-1], ctx)


@pytest.mark.parametrize("unbiased", [True, False])
def test_randk_owner_step_decodes_each_packet_at_its_own_indices(unbiased):
    """A received packet drawn under another key (another step: a rank out
    of step, or a corrupted key) decodes where its own key says, as the
    separate steps decode it; the owner packet keeps the owner's key."""
    m = 3000
    codec = hpccomm.get_codec("randk", ratio=0.02, unbiased=unbiased)
    packets, slots, e, ctx = owner_inputs("randk", {"ratio": 0.02, "unbiased": unbiased}, 3,
                                          m, seed=8)
    stray = codec.encode(np.random.default_rng(9).standard_normal(m).astype(np.float32),
                         EncodeContext(seed=2, rank=1, step=8, offset=5))
    assert stray[HEADER_SIZE:HEADER_SIZE + 8].tobytes() != \
        packets[1][HEADER_SIZE:HEADER_SIZE + 8].tobytes()
    for received in (packets[:1] + [stray] + packets[2:], [stray] * 3):
        want_packet, want_out, want_e = owner_reference(codec, received, e, m, ctx)
        out, e_out = np.empty(m, np.float32), np.empty(m, np.float32)
        assert codec.owner_step(received, e, e_out, out, ctx).tobytes() == \
            want_packet.tobytes()
        assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist()
        assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()
    with pytest.raises(ValueError, match="e must be contiguous"):
        codec.owner_step(packets, e[:-1], e_out, out, ctx)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("stray", [False, True])
def test_randk_owner_step_propagates_at_the_sent_indices(bad, stray):
    """A non-finite ``w`` at two indices the owner sends (with every packet
    of the owner's key, or one ``stray`` of another): counted once each
    under ``nonfinite="raise"``; under ``"propagate"`` the packet carries
    them and the residual there is ``w - w`` (NaN), as decode and subtract
    leave it."""
    m = 1000
    codec = hpccomm.get_codec("randk", ratio=0.05, nonfinite="propagate")
    packets, _, e, ctx = owner_inputs("randk", {"ratio": 0.05}, 2, m, seed=5)
    if stray:
        packets[1] = codec.encode(np.ones(m, np.float32), replace(ctx, step=ctx.step + 1))
    sent = random_indices(index_key(ctx.seed, ctx.step, ctx.offset), m, codec.count(m))
    e[sent[[0, -1]]] = bad
    with pytest.raises(NonFiniteError, match="holds 2 NaN/Inf"):
        hpccomm.get_codec("randk", ratio=0.05).owner_step(
            packets, e, np.empty(m, np.float32), np.empty(m, np.float32), ctx)
    want_packet, want_out, want_e = owner_reference(codec, packets, e, m, ctx)
    assert np.isnan(want_e[sent[0]])
    out, e_out = np.empty(m, np.float32), np.empty(m, np.float32)
    assert codec.owner_step(packets, e, e_out, out, ctx).tobytes() == want_packet.tobytes()
    assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist()
    assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist()


class _Received(list):
    """Packets as the transport's all-to-all returns them: equally spaced in
    one buffer (``buffer``, ``stride``)."""


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("offset, stride", [(8, 64), (9, 64), (8, 63)])
def test_float32_rows_have_the_type_and_values_of_payload_rows(count, spaced, offset, stride):
    """The owner steps of qsgd and terngrad read their packets' scales either
    as float32 rows (``payload_rows``) or as bytes turned into float32
    (``float32_rows``, viewed where aligned, else copied): the same values
    and the same numba array type, so each kernel compiles once for both."""
    import numba

    from hpccomm.codecs.base import float32_rows, payload_rows

    k = 5
    rng = np.random.default_rng(count)
    buffer = np.zeros(count * stride, np.uint8)
    packets = _Received(buffer[i * stride:(i + 1) * stride] for i in range(count)) if spaced \
        else [np.zeros(stride, np.uint8) for _ in range(count)]
    if spaced:
        packets.buffer, packets.stride = buffer, stride
    for p in packets:
        p[offset:offset + 4 * k] = rng.standard_normal(k).astype(np.float32).view(np.uint8)
    want = payload_rows(packets, offset, np.float32, k)
    got = float32_rows(payload_rows(packets, offset, np.uint8, 4 * k))
    assert np.array_equal(got, want)
    assert numba.typeof(got) == numba.typeof(want)
    assert not got.flags.writeable


@pytest.mark.parametrize("name,params,kernel,body,rows", [
    ("qsgd", {}, "qsgd.qsgd_owner_step", "_qsgd_encode", (4, 5)),
    ("terngrad", {}, "terngrad.tern_owner_add", "_tern_owner_add", (0, 1)),
    ("bf16", {}, "halfwidth._bf16_owner_rows", "_bf16_owner_step", (0,)),
    ("fp8", {}, "fp8.fp8_owner_step", "_fp8_owner_step", (0, 1))])
def test_an_owner_steps_body_compiles_once_for_both_row_layouts(monkeypatch, name, params, kernel,
                                                                body, rows):
    """One packet's rows are C-contiguous, several packets' rows in one
    buffer strided: the owner step hands its body strided rows either way
    (``strided_rows``), so the body gets no C-layout specialisation -- each
    one costs seconds of compilation on a fresh cache.  The owner step's
    arguments for one packet are recorded, and an uncached copy of it is
    compiled for them: that types (and loads or compiles) the body it
    calls, whose specialisations are then all strided."""
    import importlib

    import numba
    from numba.core import types

    module_name, fn = kernel.split(".")
    module = importlib.import_module(f"hpccomm.kernels.{module_name}")
    owner_step = getattr(module, fn)
    seen = []

    def recording(*args):
        seen.append(args)
        return owner_step(*args)

    monkeypatch.setattr(module, fn, recording)
    packets, _, e, ctx = owner_inputs(name, params, 1, 40, seed=1)
    hpccomm.get_codec(name, **params).owner_step(packets, e, np.empty(40, np.float32),
                                                 np.empty(40, np.float32), ctx)
    args = tuple(numba.typeof(a) for a in seen[0])
    assert args[0].layout == "C"                # one packet: C-contiguous rows
    numba.njit(owner_step.py_func).compile(args)
    layouts = {sig[i].layout for sig in getattr(module, body).overloads for i in rows
               if isinstance(sig[i], types.Array)}
    assert layouts == {"A"}, (body, layouts)
