"""``qsgd`` with ``elias=True`` (no MPI): the paper's Elias-omega coding of
the fixed-width codes -- against a plain-Python Elias encoder written here
from the layout in :mod:`hpccomm.codecs.qsgd`'s docstring, the same decoded
values as the fixed-width packet, the size bounds from the math, malformed
packets, options."""
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import HEADER, EncodeContext
from hpccomm.errors import PacketError
from hpccomm.kernels import elias as E

from .test_codecs_quant import (GUARD, SENTINEL, owner_inputs, owner_reference, pack_lsb_first,
                                unpack_lsb_first)

CTX = EncodeContext(seed=7, rank=3, step=11, offset=5)
PARAMS = [{}, {"bits": 2, "bucket": 7}, {"bits": 4, "bucket": 33, "norm": "max"},
          {"bits": 8, "bucket": 100}, {"bits": 2, "bucket": 512, "norm": "max"},
          {"bits": 8, "bucket": 5000, "norm": "max"}]


def pair(params, **kw):
    """The fixed-width and the Elias codec of ``params``."""
    return (hpccomm.get_codec("qsgd", **params, **kw),
            hpccomm.get_codec("qsgd", **params, elias=True, **kw))


def data(n, seed=0, sparse=False):
    rng = np.random.default_rng(seed + n)
    x = rng.standard_normal(n).astype(np.float32)
    if sparse:          # long runs of zeros: large gaps, all-zero buckets
        x[rng.random(n) < 0.97] = 0.0
    if n > 10:
        x[3] = 0.0
        x[4] *= 50
    return x


# ---------------------------------------------------------------------------
# the plain-Python reference
# ---------------------------------------------------------------------------
def omega(v):
    """Elias-omega code of ``v >= 1`` as a string of bits (Elias 1975):
    prepend ``bin(v)``, continue with ``len - 1``, end with ``0``."""
    code = "0"
    while v > 1:
        b = bin(v)[2:]
        code = b + code
        v = len(b) - 1
    return code


def ref_stream_bits(codes):
    """The bit string of one bucket's codes: per non-zero, omega(gap), the
    sign, omega(level)."""
    s, p = [], -1
    for i in np.flatnonzero(codes):
        c = int(codes[i])
        s.append(omega(int(i) - p) + ("1" if c < 0 else "0") + omega(abs(c)))
        p = int(i)
    return "".join(s)


def ref_elias(fixed, n):
    """The Elias packet (version 2) of a fixed-width packet (version 1),
    from the documented layouts."""
    hdr = fixed[:16].view(HEADER)[0]
    extra = int(hdr["extra"])
    bits, d = extra >> 28, extra & (2**28 - 1)
    nb = -(-n // d)
    scales = fixed[16:16 + 4 * nb]
    codes = unpack_lsb_first(fixed[16 + 4 * nb:], bits, n)
    table, stream = [], bytearray()
    for j in range(nb):
        s = ref_stream_bits(codes[j * d:(j + 1) * d])
        table.append(len(s))
        s += "0" * (-len(s) % 8)
        stream += bytes(int(s[k:k + 8], 2) for k in range(0, len(s), 8))
    head = fixed[:16].copy()
    head[2] = 2
    return np.concatenate([head, np.array([len(stream)], "<u8").view(np.uint8), scales,
                           np.array(table, "<u4").view(np.uint8),
                           np.frombuffer(bytes(stream), np.uint8)])


def stream_bits(packet, n, d):
    """The per-bucket bit counts T of an Elias packet."""
    nb = -(-n // d)
    return packet[24 + 4 * nb:24 + 8 * nb].view("<u4").astype(np.int64)


# ---------------------------------------------------------------------------
# Elias-omega codewords
# ---------------------------------------------------------------------------
def test_omega_codewords_against_the_reference():
    """The kernels' codewords (the table of 1 .. 2**16 - 1 and the grouped
    form beyond) against the string reference, and their lengths."""
    codes = np.empty(E.TABLE, np.uint32)
    lengths = np.empty(E.TABLE, np.uint8)
    E.omega_table(codes, lengths)
    for v in range(1, E.TABLE):
        ref = omega(v)
        assert lengths[v] == len(ref) and int(codes[v]) == int(ref, 2), v
    edges = sorted({1, 2, 3, 4, 5, 15, 16, 17} | {b + k for e in range(16, 33)
                                                   for b in (1 << e,) for k in (-1, 0, 1)})
    for v in edges:
        if v >= 2**32:
            continue
        c, m = E._omega_code(v)
        ref = omega(v)
        assert m == len(ref) == E.omega_length(v) and int(c) == int(ref, 2), v
    assert [omega(v) for v in (1, 2, 3, 4, 7, 8, 16)] == [
        "0", "100", "110", "101000", "101110", "1110000", "10100100000"]


def test_omega_lengths_up_to_2_to_the_20():
    """``|omega(v)|`` for every ``v`` in 1 .. 2**20 (the table kernel run
    that far) against a vectorized form of the recursion, and monotone."""
    N = (1 << 20) + 1
    codes = np.empty(N, np.uint32)
    lengths = np.empty(N, np.uint8)
    E.omega_table(codes, lengths)
    v = np.arange(N, dtype=np.int64)
    want = np.ones(N, np.int64)
    code = np.zeros(N, np.int64)
    cur = v.copy()
    while (cur > 1).any():
        big = cur > 1
        b = np.frexp(cur.astype(np.float64))[1]        # bit length, exact below 2**53
        code = np.where(big, code | (cur << want), code)
        want = np.where(big, want + b, want)
        cur = np.where(big, b - 1, cur)
    assert (lengths[1:] == want[1:]).all()
    assert (codes[1:] == code[1:]).all()
    assert (np.diff(lengths[1:].astype(np.int64)) >= 0).all()


# ---------------------------------------------------------------------------
# packets
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000, 4097])
@pytest.mark.parametrize("sparse", [False, True])
def test_packet_matches_the_reference_and_decodes_as_fixed_width(params, n, sparse):
    """The Elias packet is the reference coding of the fixed-width packet's
    codes and scales, and decodes (and decode-adds) to its very bits."""
    fixed, el = pair(params)
    x = data(n, sparse=sparse)
    ctx = replace(CTX, shape=(n,))
    pf, pe = fixed.encode(x, ctx), el.encode(x, ctx)
    assert pe.tobytes() == ref_elias(pf, n).tobytes()
    assert pe.size <= el.max_wire_size(n)
    a = fixed.decode(pf, np.empty(n, np.float32))
    b = el.decode(pe, np.full(n, np.nan, np.float32))
    assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()
    base = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    acc_f, acc_e = base.copy(), base.copy()
    fixed.decode_add(pf, acc_f)
    el.decode_add(pe, acc_e)
    assert acc_f.view(np.uint32).tolist() == acc_e.view(np.uint32).tolist()


def test_large_gaps_and_levels():
    """One bucket of 2**22 with non-zeros at chosen positions (max norm,
    equal magnitudes: every code at level L exactly): gaps 1 .. 2**20 and
    around every power of two, against the reference coding."""
    gaps = list(range(1, 40)) + [(1 << e) + k for e in range(5, 21) for k in (-1, 0, 1)]
    pos = np.cumsum(gaps) - 1
    n = int(pos[-1]) + 3
    x = np.zeros(n, np.float32)
    x[pos] = np.where(np.arange(pos.size) % 3 == 0, -2.0, 2.0)
    for bits in (2, 8):
        fixed, el = pair({"bits": bits, "bucket": n, "norm": "max"})
        pf, pe = fixed.encode(x), el.encode(x)
        codes = unpack_lsb_first(pf[20:], bits, n)
        assert (np.abs(codes[pos]) == fixed.levels).all() and np.count_nonzero(codes) == pos.size
        assert pe.tobytes() == ref_elias(pf, n).tobytes()
        assert el.decode(pe, np.empty(n, np.float32)).tobytes() == \
            fixed.decode(pf, np.empty(n, np.float32)).tobytes()


def test_hand_made_bucket():
    """Codes (0, +L, 0, 0, -1) at 4 bits: omega(2) 0 omega(7), omega(3) 1
    omega(1) = 100 0 101110 | 110 1 0 -> 15 bits, one padding bit."""
    fixed, el = pair({"bits": 4, "bucket": 5, "norm": "max"})
    x = np.array([0, 1, 0, 0, -1 / 7], np.float32)
    pe = el.encode(x, CTX)
    assert pe[2] == 2 and pe[16:24].view("<u8")[0] == 2
    assert pe[28:32].view("<u4")[0] == 15
    assert pe[32:].tolist() == [int("10001011", 2), int("10110100", 2)]
    assert el.decode(pe, np.empty(5, np.float32)).tolist() == [0, 1, 0, 0, np.float32(-1 / 7)]


@pytest.mark.parametrize("params", PARAMS[:4])
@pytest.mark.parametrize("n", [0, 33, 4097 * 3 + 5])
@pytest.mark.parametrize("has_e", [False, True])
def test_feedback_gives_the_fixed_width_bits(params, n, has_e):
    """``encode_with_feedback``: the residual bits of the fixed-width codec
    (the same codes, the same contracted scales) and a packet that decodes
    to the fixed-width packet's values."""
    fixed, el = pair(params)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    e = rng.standard_normal(n).astype(np.float32) * np.float32(0.2) if has_e else None
    ctx = replace(CTX, shape=(n,), feedback=has_e)
    ef, ee = np.empty(n, np.float32), np.empty(n, np.float32)
    pf = fixed.encode_with_feedback(x, e, ef, ctx)
    pe = el.encode_with_feedback(x, e, ee, ctx)
    assert ef.view(np.uint32).tolist() == ee.view(np.uint32).tolist()
    assert pe.tobytes() == ref_elias(pf, n).tobytes()


@pytest.mark.parametrize("params", [{}, {"bits": 2, "bucket": 7},
                                    {"bits": 8, "bucket": 100, "norm": "max"}])
@pytest.mark.parametrize("m", [0, 33, 4097 * 3 + 5])
@pytest.mark.parametrize("mode", ["feedback", "first", "none"])
def test_owner_step(params, m, mode):
    """``owner_step`` on Elias packets: the bits of the separate steps, and
    the same ``out`` / ``e_out`` as the fixed-width owner on the fixed-width
    packets of the same inputs."""
    fixed, el = pair(params)
    packets, slots, e, ctx = owner_inputs("qsgd", {**params, "elias": True}, 3, m, seed=m)
    fpackets, _, _, _ = owner_inputs("qsgd", params, 3, m, seed=m)
    e = None if mode != "feedback" else e
    want_packet, want_out, want_e = owner_reference(el, packets, e, m, ctx)
    fout = np.empty(m, np.float32)
    fe_out = None if mode == "none" else np.empty(m, np.float32)
    fpacket = fixed.owner_step(fpackets, e, fe_out, fout, ctx)
    for received in (packets, slots):
        out = np.full(m, np.nan, np.float32)
        e_out = None if mode == "none" else np.full(m, np.nan, np.float32)
        packet = el.owner_step(received, e, e_out, out, ctx)
        assert packet.tobytes() == want_packet.tobytes() == ref_elias(fpacket, m).tobytes()
        assert out.view(np.uint32).tolist() == want_out.view(np.uint32).tolist() \
            == fout.view(np.uint32).tolist()
        if e_out is not None:
            assert e_out.view(np.uint32).tolist() == want_e.view(np.uint32).tolist() \
                == fe_out.view(np.uint32).tolist()


def test_nonfinite_propagates_as_fixed_width():
    fixed, el = pair({"bits": 4, "bucket": 16}, nonfinite="propagate")
    x = data(100)
    x[[5, 40]] = (np.nan, np.inf)
    a = fixed.decode(fixed.encode(x, CTX), np.empty(100, np.float32))
    b = el.decode(el.encode(x, CTX), np.empty(100, np.float32))
    assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()
    assert np.isnan(b[:16]).all() and np.isnan(b[32:48]).all()
    assert np.isfinite(b[16:32]).all() and np.isfinite(b[48:]).all()


def test_unaligned_packets_decode_alike():
    el = hpccomm.get_codec("qsgd", bucket=64, elias=True)
    packet = el.encode(data(1000), CTX)
    for shift in (1, 2, 3):
        buf = np.zeros(packet.size + shift, np.uint8)
        buf[shift:] = packet
        assert el.decode(buf[shift:], np.empty(1000, np.float32)).tobytes() == \
            el.decode(packet, np.empty(1000, np.float32)).tobytes()


# ---------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits,h", [(2, 1), (2, 8), (4, 1), (4, 4), (8, 2)])
def test_worst_bucket_is_every_element_at_level_L(bits, h):
    """Over every code vector of a bucket of ``h`` (the reference coding,
    exhaustively), the longest stream has ``h (2 + |omega(L)|)`` bits --
    every element non-zero at level L -- which max_wire_size assumes."""
    L = 2 ** (bits - 1) - 1
    lens = {v: len(omega(v)) for v in range(1, max(L, h) + 1)}
    best = 0
    for codes in itertools.product(range(0, L + 1), repeat=h):   # signs cost 1 bit each
        t, p = 0, -1
        for i, c in enumerate(codes):
            if c:
                t += lens[i - p] + 1 + lens[c]
                p = i
        best = max(best, t)
    assert best == h * (2 + lens[L])
    el = hpccomm.get_codec("qsgd", bits=bits, bucket=h, norm="max", elias=True)
    x = np.ones(5 * h + 1, np.float32)
    x[::2] = -1
    p = el.encode(x)                       # every code at level L: the worst case
    assert p.size == el.max_wire_size(x.size)


def test_size_attributes():
    el = hpccomm.get_codec("qsgd", bits=4, bucket=512, elias=True)
    assert not el.fixed_size and el.wire_size(1000) is None
    assert el.wire_size_for(1000, (1000,)) is None
    # 24 + 8 B + per bucket ceil(h (2 + 6) / 8): 512 -> 512 bytes, 488 -> 488
    assert el.max_wire_size(1000) == 24 + 16 + 512 + 488
    assert el.max_wire_size(0) == 24
    el2 = hpccomm.get_codec("qsgd", bits=2, bucket=7, elias=True)
    assert el2.max_wire_size(10) == 24 + 16 + math.ceil(7 * 3 / 8) + math.ceil(3 * 3 / 8)
    assert hpccomm.get_codec("qsgd").fixed_size


def paper_bound(s, d):
    """Alistarh et al., Theorem 3.4 with o(1) = 0: expected bits of one
    bucket of ``d`` under ``s`` levels of its l2 norm."""
    k = s * (s + math.sqrt(d))
    return (3 + 1.5 * math.log2(2 * (s * s + d) / k)) * k + 32


@pytest.mark.parametrize("bits,d", [(2, 512), (4, 512), (4, 128), (4, 49), (8, 16129)])
def test_gaussian_size_within_the_papers_bound(bits, d):
    """Mean bits per bucket (the 32-bit scale plus the stream's ``T_j``) on
    Gaussian input under the l2 norm, at most the paper's expected-size
    bound; for ``s = sqrt(d)`` (4 bits and d = 49, 8 bits and d = 16129)
    also its ``2.8 d + 32`` up to 2 %."""
    el = hpccomm.get_codec("qsgd", bits=bits, bucket=d, elias=True)
    n = d * max(8, 65536 // d)
    x = np.random.default_rng(d).standard_normal(n).astype(np.float32)
    T = np.concatenate([stream_bits(el.encode(x, EncodeContext(seed=s)), n, d)
                        for s in range(2)])
    mean = 32 + T.mean()
    assert mean <= paper_bound(el.levels, d)
    if el.levels ** 2 == d:
        assert mean <= 1.02 * (2.8 * d + 32)


# ---------------------------------------------------------------------------
# malformed packets
# ---------------------------------------------------------------------------
def _fields(packet, n, d):
    nb = -(-n // d)
    return nb, 24 + 4 * nb, 24 + 8 * nb


def _check_rejected(el, packet, n, match=None):
    buf = np.full(n + 2 * GUARD, SENTINEL, dtype=np.float32)
    out = buf[GUARD:GUARD + n]
    with pytest.raises(PacketError, match=match):
        el.decode(packet, out)
    assert (buf == SENTINEL).all()       # nothing written, not even out


def test_each_malformation_is_named_and_writes_nothing():
    n, d = 60, 20
    el = hpccomm.get_codec("qsgd", bits=4, bucket=d, norm="max", elias=True)
    x = np.zeros(n, np.float32)
    x[[0, 5, 19, 20, 59]] = (1, -1, 1, 1, -1)     # level 7 everywhere (omega: 6 bits)
    p = el.encode(x)
    nb, tab, st = _fields(p, n, d)
    T = p[tab:st].view("<u4")
    # bucket 0: gaps 1, 5, 14 (omega: 1, 6, 7 bits) + 3 (1 + 6); bucket 1: gap 1;
    # bucket 2: gap 20 (omega: 11 bits)
    assert T.tolist() == [1 + 6 + 7 + 3 * 7, 1 + 7, 11 + 7]
    assert p[16:24].view("<u8")[0] == 5 + 1 + 3
    _check_rejected(el, p[:-1], n, "bytes, its header implies")
    bad = p.copy()
    bad[tab:st].view("<u4")[0] = 36           # one bit more, same bytes: reads the padding
    _check_rejected(el, bad, n, "past the end")
    bad = p.copy()
    bad[tab:st].view("<u4")[0] = 34           # one bit fewer: the last level code is cut
    _check_rejected(el, bad, n, "past the end")
    bad = p.copy()
    bad[tab:st].view("<u4")[0] = 41           # a byte more than the stream holds
    _check_rejected(el, bad, n, "does not add up")
    bad = p.copy()
    bad[tab:st].view("<u4")[0] = 8 * d + 1    # above the worst case 8 bits per element
    _check_rejected(el, bad, n, "worst case")
    bad = p.copy()
    b1 = st + 5                   # bucket 1: omega(1) 0 omega(7) = 0 0 10 111 0
    assert bad[b1] == 0b00101110
    bad[b1] = 0b00101111          # the level code goes on: a group of 8 bits, >= 128
    _check_rejected(el, bad, n, "exceeds the codec's levels")
    bad = p.copy()
    bad[-1] |= 1                  # bucket 2: 18 bits, the last 6 of its 3 bytes padding
    _check_rejected(el, bad, n, "padding")
    # a fixed-width packet to the Elias codec, and the reverse
    fixed = hpccomm.get_codec("qsgd", bits=4, bucket=d, norm="max")
    _check_rejected(el, fixed.encode(x), n, "version")
    _check_rejected(fixed, p, n, "version")


def test_gap_past_the_bucket_end():
    """A gap code that ends inside the bucket's bits but points past its
    end (bucket of 6: codes at 1, then a gap of 5 -> position 6)."""
    n = d = 6
    el = hpccomm.get_codec("qsgd", bits=2, bucket=d, norm="max", elias=True)
    x = np.zeros(n, np.float32)
    x[1] = 1.0
    p = el.encode(x)              # omega(2) 0 omega(1) = 100 0 0
    nb, tab, st = _fields(p, n, d)
    assert p[tab:st].view("<u4")[0] == 5 and p[st] == 0b10000000
    s = "100" + "0" + "0" + "101010" + "0" + "0"       # then omega(5) 0 omega(1)
    stream = bytes([int(s[:8], 2), int(s[8:].ljust(8, "0"), 2)])
    bad = np.concatenate([p[:st], np.frombuffer(stream, np.uint8)])
    bad[16:24].view("<u8")[0] = 2
    bad[tab:st].view("<u4")[0] = len(s)
    _check_rejected(el, bad, n, "gap points past the end")
    s = "100" + "0" + "0" + "1110000" + "0" + "0"      # omega(8): longer than any gap left
    stream = bytes([int(s[:8], 2), int(s[8:].ljust(8, "0"), 2)])
    bad = np.concatenate([p[:st], np.frombuffer(stream, np.uint8)])
    bad[16:24].view("<u8")[0] = 2
    bad[tab:st].view("<u4")[0] = len(s)
    _check_rejected(el, bad, n, "longer than any value")


def test_level_above_L():
    n = d = 4
    el = hpccomm.get_codec("qsgd", bits=2, bucket=d, norm="max", elias=True)  # L = 1
    x = np.array([1, 0, 0, 0], np.float32)
    p = el.encode(x)          # omega(1) 0 omega(1) = 000
    nb, tab, st = _fields(p, n, d)
    s = "0" + "0" + "100"     # level omega(2) = 100 > L = 1
    bad = p.copy()
    bad[st] = int(s, 2) << 3
    bad[tab:st].view("<u4")[0] = 5
    _check_rejected(el, bad, n, "exceeds the codec's levels")


@pytest.mark.parametrize("params", [{"bits": 2, "bucket": 7}, {"bits": 4, "bucket": 64},
                                    {"bits": 8, "bucket": 100, "norm": "max"}])
def test_fuzz_bit_flips_and_truncations(params):
    """Random bit flips anywhere after the header and every truncation:
    a PacketError with nothing written, or -- for flips that leave a valid
    packet (a sign, a scale) -- a clean decode that equals the reference
    decoding of its codes."""
    el = hpccomm.get_codec("qsgd", **params, elias=True, nonfinite="propagate")
    n = 300
    packet = el.encode(data(n, sparse=False), CTX)
    rng = np.random.default_rng(0)
    for cut in range(packet.size):
        _check_rejected(el, packet[:cut], n)
    outcomes = {"error": 0, "ok": 0}
    for trial in range(600):
        bad = packet.copy()
        for _ in range(1 + trial % 3):
            k = int(rng.integers(16, bad.size))
            bad[k] ^= np.uint8(1 << int(rng.integers(8)))
        buf = np.full(n + 2 * GUARD, SENTINEL, dtype=np.float32)
        out = buf[GUARD:GUARD + n]
        try:
            el.decode(bad, out)
        except PacketError:
            assert (buf == SENTINEL).all()
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        assert (buf[:GUARD] == SENTINEL).all() and (buf[GUARD + n:] == SENTINEL).all()
        # re-coding the decoded codes gives back the very packet: the
        # coding is canonical, so a malformed stream never decodes
        scales, codes, _, d = el._elias_codes(bad, {"n": n, "extra": int(
            bad[4:8].view("<u4")[0])}, n)
        fixed = hpccomm.get_codec("qsgd", **params)
        fp = fixed.encode(np.zeros(n, np.float32))
        nb = -(-n // d)
        fp[16:16 + 4 * nb] = scales.view(np.uint8)
        fp[16 + 4 * nb:] = pack_lsb_first(codes, fixed.bits)
        assert ref_elias(fp, n).tobytes() == bad.tobytes()
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


# ---------------------------------------------------------------------------
# options, flags, the device
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_elias_must_be_a_bool(value):
    with pytest.raises(ValueError, match="elias must be True or False"):
        hpccomm.get_codec("qsgd", elias=value)


def test_params_flags_and_summable():
    el = hpccomm.get_codec("qsgd", bits=2, bucket=64, elias=np.bool_(True))
    assert el.params() == {"bits": 2, "bucket": 64, "norm": "l2", "elias": True}
    assert el.describe() == "qsgd(bits=2,bucket=64,elias=True,norm=l2)"
    assert hpccomm.get_codec("qsgd", elias=False).params() == hpccomm.get_codec("qsgd").params()
    assert el.version == 2 and hpccomm.get_codec("qsgd").version == 1
    assert not el.summable and "elias=False" in el.summable_when
    assert hpccomm.get_codec("qsgd").summable
    assert el.segment_unit(()) == 64 and el.stochastic and el.dense


def test_the_device_twin_refuses_elias():
    pytest.importorskip("numba.cuda")
    from hpccomm.collectives.on_device import why_not_on_device
    from hpccomm.device_codecs import device_codec_for
    from hpccomm.memory import get_memory

    el = hpccomm.get_codec("qsgd", elias=True)
    assert device_codec_for(el) is None
    assert device_codec_for(hpccomm.get_codec("qsgd")) is not None

    class Alg:
        name = "twoshot"
    why = why_not_on_device(Alg(), el, get_memory("none"), "float32")
    assert "elias=True has no device kernels" in why
    assert why_not_on_device(Alg(), hpccomm.get_codec("qsgd"), get_memory("none"),
                             "float32") == ""
