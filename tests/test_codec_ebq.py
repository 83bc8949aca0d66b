"""The ``ebq`` codec (error-bounded uniform quantization, no MPI): the step,
the layout against a numpy packer, the per-element bound checked in exact
rational arithmetic on random and adversarial values, the owner's exact
sum of codes, the fused and summable forms, malformed packets, options.

Bounds come from the codec's definition (``|decode - x| <= bound`` per
element; a sum of ``P`` decoded packets within ``P bound`` of the exact sum
plus half a float32 ulp of the result), not from its own round trip."""
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hpccomm
from hpccomm import reference
from hpccomm.codecs import ebq as E
from hpccomm.codecs.base import HEADER_SIZE, EncodeContext
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels import ebq as K

SIZES = [0, 1, 63, 64, 65, 1000, 64 * 70 + 17]
BOUNDS = [1e-3, 1e-2, 0.37, 2.0 ** -20, 1e-7, 5.0, 3e10]


def codec(bound=1e-3):
    return hpccomm.get_codec("ebq", bound=bound)


def exact_err(decoded, x):
    """``max |decoded - x|`` in exact rational arithmetic."""
    return max((abs(Fraction(float(d)) - Fraction(float(v))) for d, v in zip(decoded, x)),
               default=Fraction(0))


def within(decoded, x, bound):
    """``|decoded - x| <= bound`` elementwise: float64 where that is exact
    (differences of two float32 within 2**29 of each other, or one of them
    zero), else as fractions."""
    d = decoded.astype(np.float64) - x.astype(np.float64)
    if np.all(np.abs(d) <= bound):
        return True
    return exact_err(decoded, x) <= Fraction(bound)


# ---------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------
def ref_step(bound):
    """2 bound rounded down to 4 significant bits, by exact rationals."""
    t = Fraction(2 * Fraction(bound))
    e = math.floor(math.log2(t))
    while Fraction(2) ** e > t:
        e -= 1
    while Fraction(2) ** (e + 1) <= t:
        e += 1
    M = math.floor(t / Fraction(2) ** (e - 3))
    return float(M * Fraction(2) ** (e - 3))


def ref_codes(x, s):
    """The integer nearest ``x / s``, ties to even, in exact arithmetic."""
    out = np.empty(x.size, dtype=np.int64)
    S = Fraction(s)
    for i, v in enumerate(x.tolist()):
        out[i] = round(Fraction(v) / S)        # Fraction rounds half to even
    return out


def ref_packet(x, bound, codes=None):
    c = codec(bound)
    s = c.step
    q = ref_codes(x, s) if codes is None else codes
    n = x.size
    z = ((q << 1) ^ (q >> 63)).astype(np.uint64)
    C = -(-n // 64)
    widths, payload = [], []
    for b in range(C):
        zb = z[64 * b:64 * b + 64]
        w = int(zb.max()).bit_length() if zb.size else 0
        widths.append(w)
        if w:
            bits = ((zb[:, None] >> np.arange(w, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
            payload.append(np.packbits(bits.reshape(-1), bitorder="little"))
    head = np.zeros(HEADER_SIZE, np.uint8)
    head[:4] = np.frombuffer(b"HC\x01\x0c", np.uint8)
    head[4:8] = np.frombuffer(np.uint32(64).tobytes(), np.uint8)
    head[8:16] = np.frombuffer(np.uint64(n).tobytes(), np.uint8)
    return np.concatenate([head, np.frombuffer(np.float32(s).tobytes(), np.uint8),
                           np.array(widths, np.uint8)] + payload)


def data(n, bound, seed=0):
    """N(0, sigma) with sigma a few hundred steps (codes of ~10 bits)."""
    rng = np.random.default_rng([seed, n])
    return (rng.standard_normal(n) * 300 * bound).astype(np.float32)


# ---------------------------------------------------------------------------
# step, layout
# ---------------------------------------------------------------------------
def test_step_is_twice_the_bound_rounded_down_to_four_bits():
    rng = np.random.default_rng(0)
    for b in list(rng.uniform(-60, 60, 400)) + [-9.9, 0.0, 3.0]:
        bound = float(2.0 ** b)
        s = E.step_of(bound)
        assert s == ref_step(bound)
        assert 2 * bound * 8 / 9 < s <= 2 * bound
        assert np.float32(s) == s                           # a float32
        m, _ = math.frexp(s)
        assert (m * 16).is_integer()                        # 4 significant bits
    assert codec(1e-3).step == 2.0 ** -9 and codec(0.5).step == 1.0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bound", [1e-3, 0.37])
def test_packet_matches_the_numpy_packer_and_the_size_formula(n, bound):
    c = codec(bound)
    x = data(n, bound, seed=1)
    x[:5] = x[:5] * 0           # an all-zero start (+-0)
    if n > 130:
        x[64:128] = 0           # an all-zero block: width 0, no bytes
    p = c.encode(x)
    want = ref_packet(x, bound)
    np.testing.assert_array_equal(p, want)
    C = -(-n // 64)
    widths = p[20:20 + C].astype(int)
    lens = [min(64, n - 64 * b) for b in range(C)]
    assert p.size == 20 + C + sum((m * w + 7) // 8 for m, w in zip(lens, widths))
    assert p.size <= c.max_wire_size(n) == 20 + C + sum((21 * m + 7) // 8 for m in lens)
    assert c.wire_size(n) is None and not c.fixed_size
    np.testing.assert_array_equal(c.roundtrip(x),
                                  (ref_codes(x, c.step) * c.step).astype(np.float32))


def test_hand_made_block():
    s = 2.0 ** -9
    x = np.array([0, s, -s, 2 * s, 0.5 * s, 1.5 * s, -2.5 * s, 3 * s], np.float32)
    p = codec(1e-3).encode(x)
    # codes 0 1 -1 2 0 (tie to even) 2 (tie) -2 (tie) 3 -> zig-zag 0 2 1 4 0 4 3 6: width 3
    assert p.size == 20 + 1 + 3 and p[20] == 3
    bits = "".join(format(v, "03b")[::-1] for v in (0, 2, 1, 4, 0, 4, 3, 6))
    assert p[21:].tolist() == [int(bits[8 * k:8 * k + 8][::-1], 2) for k in range(3)]


# ---------------------------------------------------------------------------
# the bound
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bound", BOUNDS)
def test_bound_on_random_inputs(n, bound):
    c = codec(bound)
    for scale in (300.0, 1.0, 0.01, 2.0 ** 19):
        x = (np.random.default_rng([n, 7]).standard_normal(n) * scale * bound)
        x = np.clip(x, -(K.QMAX - 1) * c.step, (K.QMAX - 1) * c.step).astype(np.float32)
        y = c.roundtrip(x)
        assert within(y, x, bound), (scale, exact_err(y, x))


def adversarial(c):
    """Values that stress rounding: exact half-steps (small and near the code
    limit), their float32 neighbours, the largest codes, subnormals, +-0."""
    s = c.step
    ks = np.array([0, 1, 2, 3, 1001, 2**19 + 1, K.QMAX - 2, K.QMAX - 1], np.float64)
    half = np.concatenate([(ks + 0.5) * s, -(ks + 0.5) * s])
    vals = [half, ks * s, -ks * s, (ks + 0.49999) * s, K.QMAX * s * np.ones(1),
            -K.QMAX * s * np.ones(1), (K.QMAX + 0.4999) * s * np.ones(1)]
    x = np.concatenate(vals).astype(np.float32)
    x = x[np.abs(x.astype(np.float64)) <= (K.QMAX + 0.49) * s]
    tiny = np.array([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, -1.17549435e-38, s / 2, -s / 2],
                    np.float32)
    near = np.concatenate([np.nextafter(x, np.float32(np.inf)),
                           np.nextafter(x, np.float32(-np.inf))])
    near = near[np.abs(near.astype(np.float64)) <= (K.QMAX + 0.49) * s]
    return np.concatenate([x, tiny, near]).astype(np.float32)


@pytest.mark.parametrize("bound", BOUNDS + [2.0 ** -100, 2.0 ** 64, 0.75 * 2.0 ** -10])
def test_bound_on_adversarial_values_exactly(bound):
    """In exact rationals: every decoded value within ``bound`` of its input,
    and equal to ``q s`` exactly (no float32 rounding in the decode)."""
    c = codec(bound)
    x = adversarial(c)
    y = c.roundtrip(x)
    assert exact_err(y, x) <= Fraction(bound)
    q = np.rint(y.astype(np.float64) / c.step)
    assert all(Fraction(float(v)) == int(k) * Fraction(c.step) for v, k in zip(y, q))
    assert np.all(np.abs(q) <= K.QMAX)
    # -0 decodes to +0 (code 0); the fused kernel agrees with the plain one
    e_out = np.empty_like(x)
    np.testing.assert_array_equal(c.encode_with_feedback(x, None, e_out, EncodeContext()),
                                  c.encode(x))


def test_values_beyond_the_code_range_raise():
    c = codec(1e-3)
    s = c.step
    for v in [(K.QMAX + 0.5) * s, -(K.QMAX + 0.5) * s, (K.QMAX + 1) * s, 3e38, -1e30]:
        x = np.zeros(100, np.float32)
        x[77] = v
        with pytest.raises(ValueError, match="beyond the code range") as info:
            c.encode(x, EncodeContext(offset=1000))
        assert "index 1077" in str(info.value)
        with pytest.raises(ValueError, match="beyond the code range"):
            c.to_summable(x, None, EncodeContext())
        with pytest.raises(ValueError, match="beyond the code range"):
            c.encode_with_feedback(x, None, np.empty_like(x), EncodeContext())
    # the reducer's check before the agreement: one step of margin with a
    # residual, T summed terms
    lim = (K.QMAX - 1) * s
    c.check_values(np.array([lim], np.float32), feedback=True)
    with pytest.raises(ValueError, match="beyond the code range"):
        c.check_values(np.array([0, np.nextafter(np.float32(lim), np.float32(np.inf))],
                                np.float32), feedback=True)
    with pytest.raises(ValueError, match="over 4 summed inputs"):
        c.check_values(np.array([K.QMAX * s / 4 * 1.001], np.float32), terms=4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_raises(bad):
    x = np.ones(70, np.float32)
    x[66] = bad
    c = codec()
    for fn in (lambda: c.encode(x),
               lambda: c.encode_with_feedback(x, None, np.empty_like(x), EncodeContext()),
               lambda: c.to_summable(x, None, EncodeContext())):
        with pytest.raises(NonFiniteError):
            fn()


# ---------------------------------------------------------------------------
# sums of codes: the owner, allgather's decode, summable
# ---------------------------------------------------------------------------
def sum_bound_ok(result, xs, bound):
    """``|result - sum(xs)| <= P bound + ulp(result) / 2`` in exact rationals."""
    P = len(xs)
    for i, r in enumerate(result.tolist()):
        exact = sum(Fraction(float(x[i])) for x in xs)
        half_ulp = Fraction(float(np.spacing(np.float32(abs(r))))) / 2
        if abs(Fraction(r) - exact) > P * Fraction(bound) + half_ulp:
            return False
    return True


def owner_inputs(P, m, bound, kind, seed=0):
    c = codec(bound)
    rng = np.random.default_rng([seed, P, m])
    if kind == "random":
        return [data(m, bound, seed=seed + r) for r in range(P)]
    if kind == "half-steps":    # every error +s/2 or close to it, same sign on every rank
        k = rng.integers(-1000, 1000, m).astype(np.float64)
        return [((k + 0.5 - 1e-4) * c.step).astype(np.float32) for _ in range(P)]
    # codes near the limit, one sign per element on every rank: sums beyond
    # 2**20, decoded with one rounding
    sign = rng.choice([-1.0, 1.0], m)
    return [(sign * (rng.integers(K.QMAX - 1000, K.QMAX - 1, m) + 0.4) * c.step).astype(
        np.float32) for _ in range(P)]


#: a step of 4 significant bits (15 2**-13): float32 sums of decoded values
#: round beyond 2**20 codes (1e-3's step, 2**-9, sums exactly up to 2**24)
BOUND15 = 9.4e-4


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [0, 1, 65, 1000])
@pytest.mark.parametrize("kind", ["random", "half-steps", "large"])
@pytest.mark.parametrize("bound", [1e-3, BOUND15])
def test_owner_step_sums_codes_exactly(P, m, kind, bound):
    c = codec(bound)
    assert bound != BOUND15 or c.step == 15 * 2.0 ** -13
    xs = owner_inputs(P, m, bound, kind)
    packets = [c.encode(x) for x in xs]
    out = np.empty(m, np.float32)
    packet = c.owner_step(packets, None, None, out, EncodeContext())
    # the owner packet decodes to out on every rank, and to the codes' sum
    np.testing.assert_array_equal(c.decode(packet, np.empty(m, np.float32)), out)
    q = sum(ref_codes(x, c.step) for x in xs) if m else np.zeros(0, np.int64)
    np.testing.assert_array_equal(out, (q * c.step).astype(np.float32))
    np.testing.assert_array_equal(packet, ref_packet(np.zeros(m, np.float32), bound, codes=q))
    assert sum_bound_ok(out, xs, bound)
    # allgather's decode and summable's integer sum: the same bits, any order
    np.testing.assert_array_equal(c.decode_sum(packets[::-1], np.empty(m, np.float32)), out)
    codes = [c.to_summable(x, None, EncodeContext()) for x in xs]
    total = np.sum([cd.astype(c.summable_dtype(P)) for cd in codes], axis=0) if m else \
        np.zeros(0, np.int32)
    np.testing.assert_array_equal(c.from_summable(total, None, np.empty(m, np.float32)), out)
    # an owner residual of zeros (what this exact owner keeps) changes nothing
    e_out = np.full(m, np.nan, np.float32)
    again = c.owner_step(packets, np.zeros(m, np.float32), e_out, np.empty(m, np.float32),
                         EncodeContext())
    np.testing.assert_array_equal(again, packet)
    assert np.all(e_out == 0)
    if kind != "large":     # within 2**20 the float32 three-step owner gives the same bits
        acc = np.zeros(m, np.float32)
        for p in packets:
            c.decode_add(p, acc)
        np.testing.assert_array_equal(c.reencode(acc), packet)


def test_owner_folds_a_residual_into_the_codes():
    c = codec(1e-3)
    x = data(100, 1e-3)
    e = (np.random.default_rng(3).uniform(-3, 3, 100) * c.step).astype(np.float32)
    out, e_out = np.empty(100, np.float32), np.empty(100, np.float32)
    c.owner_step([c.encode(x)], e, e_out, out, EncodeContext())
    qe = ref_codes(e, c.step)
    np.testing.assert_array_equal(out, ((ref_codes(x, c.step) + qe) * c.step).astype(np.float32))
    np.testing.assert_array_equal(e_out, e - (qe * c.step).astype(np.float32))
    assert np.all(np.abs(e_out) <= c.bound)


def test_summable_dtype_and_flags():
    c = codec()
    assert c.summable_dtype(2) == np.int32 and c.summable_dtype(2048) == np.int32
    assert c.summable_dtype(2049) == np.int64
    assert 2048 * K.QMAX <= 2**31 - 1 < 2049 * K.QMAX
    assert c.shared_scale(np.ones(3, np.float32)) is None
    assert c.summable and c.dense and not c.biased and not c.stochastic and not c.lossless
    assert c.codec_id == 12 and "ebq" in hpccomm.available_codecs()
    assert c.align(()) == c.segment_unit(()) == 64


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4097])
@pytest.mark.parametrize("has_e", [False, True])
def test_encode_with_feedback_equals_the_three_steps(n, has_e):
    c = codec(1e-2)
    x = data(n, 1e-2, seed=4)
    e = (np.random.default_rng(5).uniform(-0.5, 0.5, n) * c.step).astype(np.float32)
    v = x + e if has_e else x
    e_out = np.empty(n, np.float32)
    p = c.encode_with_feedback(x, e if has_e else None, e_out, EncodeContext())
    np.testing.assert_array_equal(p, c.encode(v))
    np.testing.assert_array_equal(e_out, v - c.roundtrip(v))
    assert np.all(np.abs(e_out) <= c.bound)


def codes_of_width(rng, n, w, sparse):
    """int64 codes whose zig-zag codes have bit length exactly ``w`` in every
    block of 64 (the block's first element the widest), some blocks
    mostly zeros."""
    if w == 0:
        return np.zeros(n, np.int64)
    z = rng.integers(0, 1 << w, n, dtype=np.uint64)
    if sparse:
        z[rng.random(n) < 0.7] = 0
    z[::64] = np.uint64((1 << w) - 1 - int(rng.integers(0, 1 << (w - 1))))
    q = (z >> np.uint64(1)).astype(np.int64) ^ -(z & np.uint64(1)).astype(np.int64)
    return q


@pytest.mark.parametrize("tail", [0, 1, 37, 63])
def test_word_packer_matches_the_numpy_packer_at_every_width(tail):
    """Every width 0..50 (full blocks go through 64-bit words, the last
    partial block byte by byte): the owner's packer against the numpy
    packer byte for byte, at an unaligned payload offset, and its decode and
    code sum back to the codes exactly."""
    rng = np.random.default_rng([11, tail])
    n = 3 * 64 + tail
    C = -(-n // 64)
    s = 2.0 ** -9
    for w in range(K.WIDTH_MAX + 1):
        for sparse in (False, True):
            q = codes_of_width(rng, n, w, sparse)
            widths = np.empty(C, np.uint8)
            nbytes, _ = K.ebq_sizes(q, widths)
            assert np.all(widths == w)
            want = ref_packet(np.zeros(n, np.float32), 1e-3, codes=q)[20 + C:]
            buf = np.full(nbytes + 9, 0xA5, np.uint8)
            assert K.ebq_pack(q, widths, buf[3:3 + nbytes]) == nbytes == want.size
            np.testing.assert_array_equal(buf[3:3 + nbytes], want)
            assert np.all(buf[:3] == 0xA5) and np.all(buf[3 + nbytes:] == 0xA5)
            acc = np.arange(n, dtype=np.int64)
            K.ebq_add_codes(widths, buf[3:3 + nbytes], acc)
            np.testing.assert_array_equal(acc - np.arange(n), q)
            out = np.ones(n, np.float32)
            K.ebq_decode(widths, buf[3:3 + nbytes], s, out, True)
            np.testing.assert_array_equal(out, (q * s).astype(np.float32) + np.float32(1))


@pytest.mark.parametrize("n", [64, 64 * 9 + 5])
def test_encode_at_every_worker_width_matches_the_numpy_packer(n):
    """Inputs whose codes span widths 0..21 block by block (plus half-steps,
    -0 and a residual): the packet byte for byte, fused or not."""
    c = codec(1e-3)
    rng = np.random.default_rng([12, n])
    for scale in [0.0, 0.3, 1.0, 5.0, 100.0, 3000.0, K.QMAX - 1.0]:
        k = rng.integers(-int(scale) - 1, int(scale) + 2, n).astype(np.float64)
        x = (np.clip(k + rng.choice([0.0, 0.5, -0.5, 0.3], n), -K.QMAX, K.QMAX)
             * c.step).astype(np.float32)
        x[::7] = -0.0
        np.testing.assert_array_equal(c.encode(x), ref_packet(x, 1e-3))
        e = np.zeros(n, np.float32)
        e_out = np.empty(n, np.float32)
        p = c.encode_with_feedback(x, e, e_out, EncodeContext())
        np.testing.assert_array_equal(p, ref_packet(x, 1e-3))
        np.testing.assert_array_equal(e_out, x - c.roundtrip(x))


# ---------------------------------------------------------------------------
# malformed packets
# ---------------------------------------------------------------------------
GUARD, SENTINEL = 16, np.float32(-12345.5)


def guarded(c, packet, n, add=False):
    buf = np.full(n + 2 * GUARD, SENTINEL, np.float32)
    out = buf[GUARD:GUARD + n]
    try:
        (c.decode_add if add else c.decode)(packet, out)
    finally:
        assert np.all(buf[:GUARD] == SENTINEL) and np.all(buf[GUARD + n:] == SENTINEL)
    return out


def test_malformed_packets_raise_before_writing():
    c = codec()
    n = 200
    p = c.encode(data(n, 1e-3))
    cases = {"truncated": p[:-1], "trailing": np.concatenate([p, [0]]),
             "no widths": p[:22], "header only": p[:16]}
    wide = p.copy()
    wide[20] = 51
    cases["width 51"] = wide
    off = p.copy()
    off[16:20] = np.frombuffer(np.float32(0.5).tobytes(), np.uint8)
    cases["other step"] = off
    blk = p.copy()
    blk[4] = 32
    cases["block 32"] = blk
    for why, bad in cases.items():
        buf = np.full(n, SENTINEL, np.float32)
        with pytest.raises(PacketError):
            c.decode(bad, buf)
        assert np.all(buf == SENTINEL), why
        with pytest.raises(PacketError):
            c.decode_sum([p, bad], buf)
        with pytest.raises(PacketError):
            c.owner_step([p, bad], None, None, buf, EncodeContext())
        assert np.all(buf == SENTINEL), why
    # a packet of another bound is refused, not decoded at the wrong step
    with pytest.raises(PacketError, match="step"):
        codec(2e-3).decode(p, np.empty(n, np.float32))
    # a width one bit short of the data's is a different size: refused
    short = p.copy()
    short[20] = max(int(p[20]) - 1, 0)
    with pytest.raises(PacketError):
        c.decode(short, np.empty(n, np.float32))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([0, 1, 7, 64, 65, 200]), st.sampled_from(["truncate", "extend", "flip",
                                                                 "header"]),
       st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=12), st.booleans())
def test_fuzzed_packets_raise_or_decode_safely(n, how, pos, blob, add):
    """Random truncations, extensions and byte changes: PacketError, or a
    decode of exactly ``n`` values that writes nothing outside them."""
    c = codec()
    p = c.encode(data(n, 1e-3, seed=9)).copy()
    if how == "truncate":
        p = p[:pos % p.size]
    elif how == "extend":
        p = np.concatenate([p, np.frombuffer(blob, np.uint8)])
    elif how == "flip":
        for k, b in enumerate(blob):
            p[HEADER_SIZE + (pos + 5 * k) % (p.size - HEADER_SIZE)] ^= b
    else:
        for k, b in enumerate(blob[:4]):
            p[(pos + 3 * k) % HEADER_SIZE] = b
    try:
        y = guarded(c, p, n, add)
    except PacketError:
        return
    assert y.size == n


# ---------------------------------------------------------------------------
# options, model
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [0, -1e-3, math.nan, math.inf, "1e-3", True, None,
                                   2.0 ** -101, 2.0 ** 65])
def test_bad_bounds(bound):
    with pytest.raises(ValueError, match="bound"):
        codec(bound)


def test_options_and_description():
    c = codec(0.01)
    assert c.params() == {"bound": 0.01} and c.describe() == "ebq(bound=0.01)"
    assert codec(np.float32(0.5)).bound == 0.5 and codec(2).step == 4.0
    assert hpccomm.get_codec("ebq").bound == 1e-3
    with pytest.raises(ValueError, match="nonfinite"):
        hpccomm.get_codec("ebq", nonfinite="propagate")


def test_error_model_is_the_uniform_error_of_the_step():
    c = codec(1e-2)
    stage = reference.stage_model(c, 10000)
    assert stage.mse == (c.step ** 2 / 12, c.step ** 2 / 12) and stage.owner(5) == 1.0
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    mse = float(np.mean((c.roundtrip(x) - x).astype(np.float64) ** 2))
    assert abs(mse / stage.mse[0] - 1) < 0.05
