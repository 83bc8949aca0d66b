"""The ``fp8`` codec (block-scaled e4m3 / e5m2, no MPI): layout, rounding
against ml_dtypes, accuracy, fused kernels, malformed packets, options."""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels import fp8 as K

FORMATS = [("e4m3", 448.0), ("e5m2", 57344.0)]


def codec(**kw):
    return hpccomm.get_codec("fp8", **kw)


def ml_type(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2


def rel_l2(fmt, block, n=1 << 18, seed=0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    y = codec(format=fmt, block=block).roundtrip(x)
    return float(np.linalg.norm((y - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64)))


def test_packet_layout_on_a_hand_made_block():
    x = np.zeros(40, np.float32)
    x[:5] = (448.0, -1.0, 0.5, -0.0, 3.0)     # block 0: amax 448, scale 1
    x[32:35] = (2.0, -0.25, 1.0)                # block 1 (8 entries): scale 2/448
    p = codec().encode(x)
    assert p.size == 16 + 4 * 2 + 40 == codec().wire_size(40)
    assert bytes(p[:4]) == b"HC\x01\x0b"
    assert p[4:8].view("<u4")[0] == 32 | 0 << 16 and p[8:16].view("<u8")[0] == 40
    scales = p[16:24].view("<f4")
    assert scales[0] == np.float32(1.0) and scales[1] == np.float32(2.0) / np.float32(448.0)
    codes = p[24:]
    # e4m3: 448 = 1.75 * 2**8 -> 0 1111 110; -1 -> 1 0111 000; 0.5 -> 0 0110 000;
    # -0 -> 0x80; 3 = 1.5 * 2 -> 0 1000 100
    assert codes[:5].tolist() == [0x7E, 0xB8, 0x30, 0x80, 0x44]
    assert codes[5:32].tolist() == [0] * 27
    # block 1: 2 / s = 448 (0x7E), -0.25 / s = -56 (1 1100 110), 1 / s = 224 (0 1110 110)
    assert codes[32:35].tolist() == [0x7E, 0xE6, 0x76]
    e5 = codec(format="e5m2", block=256).encode(x)
    assert e5[4:8].view("<u4")[0] == 256 | 1 << 16 and e5.size == 16 + 4 + 40


@pytest.mark.parametrize("fmt,fmax", FORMATS)
def test_rounding_matches_ml_dtypes_over_many_bit_patterns(fmt, fmax):
    """The integer rounding against ml_dtypes' conversion of the same float32
    values: every 2**-9 step of the exponent range (normals, subnormals, the
    ties between them and their neighbours), random patterns, zeros, max."""
    t = ml_type(fmt)
    rng = np.random.default_rng(1)
    hi = np.arange(0x30000000, 0x47800000, 1 << 9, dtype=np.uint32)    # ~2**-31 .. 2**16
    ties = np.arange(0, 256, dtype=np.uint8).view(t).astype(np.float32)
    ties = ties[np.isfinite(ties)]
    mids = ((ties[:-1].astype(np.float64) + ties[1:]) / 2).astype(np.float32)
    u = np.concatenate([hi, hi | 0x80000000, rng.integers(0, 0x477FFFFF, 200_000, dtype=np.uint32),
                        mids.view(np.uint32), np.nextafter(mids, 0).view(np.uint32),
                        np.nextafter(mids, np.inf).view(np.uint32), ties.view(np.uint32),
                        np.array([0, 0x80000000, 1, 0x80000001], np.uint32)])
    x = u.view(np.float32)
    x = x[np.abs(x) <= fmax]          # beyond: ml_dtypes overflows, we saturate (below)
    got = np.empty(x.size, np.uint8)
    K.fp8_scaled_bits(x, fmt == "e5m2", got)
    want = x.astype(t).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    dec = np.empty(x.size, np.float32)
    K.fp8_decode(got, np.ones(1, np.float32), fmt == "e5m2", x.size or 1, dec, False)
    np.testing.assert_array_equal(dec.view(np.uint32), want.view(t).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt,fmax", FORMATS)
def test_saturation_and_specials(fmt, fmax):
    x = np.array([fmax * 1.1, -3.4e38, np.inf, -np.inf, np.nan], np.float32)
    got = np.empty(x.size, np.uint8)
    K.fp8_scaled_bits(x, fmt == "e5m2", got)
    top = 0x7B if fmt == "e5m2" else 0x7E
    assert got[:2].tolist() == [top, top | 0x80]
    assert got[2:].tolist() == ([0x7C, 0xFC, 0x7E] if fmt == "e5m2" else [0x7F, 0xFF, 0x7F])
    # finite input never decodes to inf: blocks with huge and tiny scales
    y = np.array([3.4028235e38, -3.4e38, 1.0] + [1e-45, -2e-45] * 20, np.float32)
    r = codec(format=fmt).roundtrip(y)
    assert np.all(np.isfinite(r)) and r[0] > 3.3e38


def test_nonfinite_policies():
    x = np.ones(70, np.float32)
    x[3], x[40], x[41] = np.nan, np.inf, -np.inf
    with pytest.raises(NonFiniteError):
        codec().encode(x)
    with pytest.raises(NonFiniteError):
        codec().encode_with_feedback(x, None, np.empty(70, np.float32), EncodeContext())
    for fmt in ("e4m3", "e5m2"):
        y = codec(format=fmt, nonfinite="propagate").roundtrip(x)
        assert np.isnan(y[3]) and np.all(np.delete(y, [3, 40, 41]) == 1.0)
        if fmt == "e5m2":
            assert y[40] == np.inf and y[41] == -np.inf
        else:                                   # e4m3fn has no infinity
            assert np.isnan(y[40]) and np.isnan(y[41])


def test_relative_l2_on_gaussian_input():
    errs = {(f, b): rel_l2(f, b) for f in ("e4m3", "e5m2") for b in (32, 256)}
    print("fp8 rel L2:", {f"{f}/{b}": round(v, 5) for (f, b), v in errs.items()})
    assert errs["e4m3", 32] <= 0.07
    assert 0.02 < errs["e4m3", 32] < 0.03 and 0.02 < errs["e4m3", 256] < 0.03
    assert 0.04 < errs["e5m2", 32] < 0.06 and 0.04 < errs["e5m2", 256] < 0.06


@pytest.mark.parametrize("params", [{}, {"format": "e5m2", "block": 64}, {"block": 256}])
@pytest.mark.parametrize("n", [0, 1, 31, 33, 1000])
def test_fused_steps_equal_the_separate_steps(params, n):
    c = codec(**params)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[:min(n, 4)] = np.array([0.0, -0.0, 1e-40, 7e4], np.float32)[:min(n, 4)]
    e = (rng.standard_normal(n) * 0.1).astype(np.float32)
    for ee in (None, e):
        e_out = np.full(n, np.nan, np.float32)
        p = c.encode_with_feedback(x, ee, e_out, EncodeContext())
        v = x if ee is None else x + ee
        want = c.encode(v)
        assert p.tobytes() == want.tobytes()
        assert e_out.tobytes() == (v - c.decode(want, np.empty(n, np.float32))).tobytes()
    received = [c.encode((rng.standard_normal(n) * (r + 1)).astype(np.float32)) for r in range(3)]
    for ee, fb in ((None, False), (e, True), (None, True)):
        out = np.empty(n, np.float32)
        e_out = np.empty(n, np.float32) if fb else None
        p = c.owner_step(received, ee, e_out, out, EncodeContext())
        acc = np.zeros(n, np.float32)
        for q in received:
            c.decode_add(q, acc)
        w = acc if ee is None else acc + ee
        want = c.encode(w)
        dec = c.decode(want, np.empty(n, np.float32))
        assert p.tobytes() == want.tobytes() and out.tobytes() == dec.tobytes()
        if fb:
            assert e_out.tobytes() == (w - dec).tobytes()


def test_malformed_packets():
    c = codec()
    p = c.encode(np.random.default_rng(2).standard_normal(100).astype(np.float32))
    out = np.empty(100, np.float32)
    for bad in (p[:-1], np.concatenate([p, p[:1]]), p[:20]):
        with pytest.raises(PacketError):
            c.decode(bad.copy(), out)
    for extra in (0, 31, 33, 512, 1 << 16 | 16, 2 << 16 | 32, 0xFF << 16 | 32):
        bad = p.copy()
        bad[4:8].view("<u4")[0] = extra
        with pytest.raises(PacketError):
            c.decode(bad, out)
    other = codec(format="e5m2", block=64).encode(np.ones(100, np.float32))
    with pytest.raises(PacketError):     # a chunk's packets must share block and format
        c.owner_step([p, other], None, None, np.empty(100, np.float32), EncodeContext())
    np.testing.assert_array_equal(c.decode(other, out), np.ones(100, np.float32))


@pytest.mark.parametrize("kw", [{"block": 16}, {"block": 48}, {"block": 512}, {"block": 32.0},
                                {"block": True}, {"block": "32"}, {"format": "e4m3fn"},
                                {"format": None}, {"nonfinite": "ignore"}])
def test_option_validation(kw):
    with pytest.raises(ValueError):
        codec(**kw)


def test_options_and_alignment():
    c = codec(format="e5m2", block=128)
    assert c.params() == {"format": "e5m2", "block": 128} and c.biased and c.dense
    assert c.align((1000,)) == c.segment_unit((1000,)) == 128
    with pytest.raises(ValueError, match=r"fp8: block must be one of 32, 64, 128, 256, not 100"):
        codec(block=100)
