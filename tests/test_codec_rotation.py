"""``rotate=True`` (the randomized Hadamard rotation before a dense quantizer,
no MPI): the transform against a dense Hadamard matrix, orthogonality and
inverse, the layout, chunk / segment invariance, the fused steps, malformed
packets, options, and the accuracy target on heavy-tailed input."""
import math

import numpy as np
import pytest
from mpi4py import MPI

import hpccomm
from hpccomm import reference
from hpccomm.codecs.base import EncodeContext
from hpccomm.codecs.rotation import PREFIX, RotatedCodec
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels import hadamard as K
from hpccomm.kernels.rng import stream_key
from hpccomm.options import option_names, resolve_options

EPS = 2.0 ** -24        # float32 unit roundoff
#: sizes that are not multiples of any block: every trailing piece decomposes
AWKWARD = [0, 1, 2, 3, 5, 7, 31, 100, 1000, 1025, 4097 * 3 + 5]


def hadamard(s):
    """The Sylvester-Hadamard matrix of order ``s`` (scipy's when available)."""
    try:
        from scipy.linalg import hadamard as scipy_hadamard
        return scipy_hadamard(s).astype(np.float64)
    except ImportError:
        h = np.ones((1, 1))
        while h.shape[0] < s:
            h = np.block([[h, h], [h, -h]])
        return h


def dense_rotation(x, d, block):
    """``y`` per piece as ``2**(-j/2) H_s (d[:s] x)`` in float64 with dense
    matrices, and the float32 error bound of each entry: a tree of ``j``
    additions per entry, then one product (``(j + 1) u c sum |x|`` plus
    the rounding of ``c`` itself)."""
    y = np.empty(x.size)
    bound = np.empty(x.size)
    lo = 0
    for s in K.piece_sizes(x.size, block):
        j = s.bit_length() - 1
        v = d[:s].astype(np.float64) * x[lo:lo + s]
        y[lo:lo + s] = hadamard(s) @ v / math.sqrt(s)
        bound[lo:lo + s] = (j + 2) * EPS * np.abs(v).sum() / math.sqrt(s)
        lo += s
    return y, bound


def signs(seed=0, step=0, block=1024):
    return K.signs(stream_key(seed, 0, step, 13), block)


def data(n, seed=0, heavy=False):
    rng = np.random.default_rng(seed + n)
    return (rng.standard_t(3, n) if heavy else rng.standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize("block", [2, 8, 64, 1024])
@pytest.mark.parametrize("n", AWKWARD)
def test_transform_matches_a_dense_hadamard_matrix(block, n):
    x = data(n, seed=block)
    d = signs(block=block)
    y = np.empty(n, np.float32)
    assert K.rotate(x, x, False, d, block, y) == (0, 0)
    want, bound = dense_rotation(x, d, block)
    assert (np.abs(y - want) <= bound).all()
    # and with e: the rotation of the float32 sum x + e
    e = data(n, seed=block + 1)
    ye = np.empty(n, np.float32)
    K.rotate(x, e, True, d, block, ye)
    K.rotate(x + e, x, False, d, block, y)
    assert ye.tobytes() == y.tobytes()


def test_pieces_are_the_binary_form_of_the_tail():
    assert K.piece_sizes(1024 * 2 + 7, 1024) == [1024, 1024, 4, 2, 1]
    assert K.piece_sizes(5, 8) == [4, 1] and K.piece_sizes(0, 8) == []
    for n in AWKWARD:
        for b in (2, 64, 1024):
            assert sum(K.piece_sizes(n, b)) == n


@pytest.mark.parametrize("n", [64, 100, 127])
def test_rotation_is_orthogonal_and_its_own_inverse(n):
    """The matrix of ``R`` (columns: rotated unit vectors) has ``R^T R = I``
    within float32 rounding, and ``unrotate`` is ``R^T``."""
    block = 64
    d = signs(block=block)
    eye = np.eye(n, dtype=np.float32)
    R = np.empty((n, n))
    Rt = np.empty((n, n))
    col = np.empty(n, np.float32)
    for i in range(n):
        K.rotate(eye[i], eye[i], False, d, block, col)
        R[:, i] = col
        K.unrotate(eye[i], d, block, col, False)
        Rt[:, i] = col
    assert np.abs(R.T @ R - np.eye(n)).max() <= 4 * EPS
    assert np.abs(Rt - R.T).max() <= 2 * EPS


@pytest.mark.parametrize("block", [2, 64, 1024])
@pytest.mark.parametrize("n", AWKWARD)
def test_unrotate_inverts_rotate(block, n):
    """``R^T R x = x`` within ``2 (k + 2) u`` of each piece's l2 norm
    (each entry of a rotated piece is off by at most (k + 2) u |x|_1 / sqrt(s)
    <= (k + 2) u |x|_2), and ``add`` adds."""
    x = data(n, seed=3)
    d = signs(step=1, block=block)
    y = np.empty(n, np.float32)
    K.rotate(x, x, False, d, block, y)
    back = np.empty(n, np.float32)
    K.unrotate(y, d, block, back, False)
    lo = 0
    for s in K.piece_sizes(n, block):
        k = s.bit_length() - 1
        tol = 2 * (k + 2) * EPS * np.linalg.norm(x[lo:lo + s].astype(np.float64))
        assert np.abs(back[lo:lo + s] - x[lo:lo + s]).max() <= tol + 1e-45
        lo += s
    acc = np.ones(n, np.float32)
    K.unrotate(y, d, block, acc, True)
    np.testing.assert_array_equal(acc, np.float32(1) + back)
    K.unrotate(y, d, block, y, False)      # in place
    np.testing.assert_array_equal(y, back)


def test_signs_are_shared_by_ranks_and_change_with_seed_and_step():
    c = hpccomm.get_codec("qsgd", rotate=True)
    x = data(3000)
    keys = {c.encode(x, EncodeContext(seed=s, rank=r, step=t))[16:24].tobytes()
            for s, r, t in [(1, 0, 2), (1, 3, 2), (1, 7, 2)]}
    assert len(keys) == 1
    assert len({c.encode(x, EncodeContext(seed=s, step=t))[16:24].tobytes()
                for s, t in [(1, 2), (2, 2), (1, 3)]}) == 3
    d = signs(block=4096)
    assert abs(d.sum()) < 5 * math.sqrt(4096) and set(d.tolist()) == {-1.0, 1.0}


def test_packet_layout():
    n = 1000
    c = hpccomm.get_codec("qsgd", bits=4, bucket=64, rotate=True, rotate_block=256)
    inner = hpccomm.get_codec("qsgd", bits=4, bucket=64)
    ctx = EncodeContext(seed=4, rank=2, step=9, offset=512)
    p = c.encode(data(n), ctx)
    assert p.size == PREFIX + inner.wire_size(n) == c.wire_size(n) == 24 + inner.wire_size(n)
    assert bytes(p[:4]) == b"HC\x01\x0d"
    assert p[4:8].view("<u4")[0] == 8 | 5 << 8 and p[8:16].view("<u8")[0] == n
    key = stream_key(4, 0, 9, 13)
    assert p[16:24].view("<u8")[0] == key
    # the inner packet: the inner codec's packet of the rotated vector
    y = np.empty(n, np.float32)
    K.rotate(data(n), data(n), False, K.signs(key, 256), 256, y)
    assert p[24:].tobytes() == inner.encode(y, ctx).tobytes()
    dec = inner.decode(p[24:], np.empty(n, np.float32))
    want = np.empty(n, np.float32)
    K.unrotate(dec, K.signs(key, 256), 256, want, False)
    np.testing.assert_array_equal(c.decode(p, np.empty(n, np.float32)), want)
    assert c.max_wire_size(n) == p.size
    one = hpccomm.get_codec("onebit", rotate=True)
    assert one.wire_size(n) is None and one.wire_size_for(n, (10, 100)) == \
        24 + hpccomm.get_codec("onebit").wire_size_for(n, (10, 100))


CHUNKED = [("qsgd", {"bits": 4, "bucket": 64, "rotate_block": 256}),
           ("qsgd", {"bits": 2, "bucket": 512, "norm": "max"}),
           ("onebit", {"col_len": 100, "rotate_block": 64}),
           ("fp8", {"rotate_block": 16})]


@pytest.mark.parametrize("name,params", CHUNKED)
def test_aligned_pieces_encode_like_the_whole(name, params):
    """Encoding ``[0, n)`` in pieces cut at multiples of ``align`` (chunks)
    or of ``segment_unit`` (segments), each with its offset, decodes to the
    bits of the whole -- the trailing piece keeps the whole's tail.  (Not
    for terngrad, whose scale spans the chunk: rotated, its ``segment_unit``
    is None; unrotated its pieces share the chunk's scale, tested in
    ``test_pipelined_mpi``.)"""
    c = hpccomm.get_codec(name, rotate=True, **params)
    shape = (5000,)
    unit = c.segment_unit(shape)
    assert c.align(shape) % c.block == 0 and unit % c.block == 0
    assert hpccomm.get_codec("terngrad", rotate=True).segment_unit(shape) is None
    n = 3 * c.align(shape) + 77
    x = data(n, seed=7)
    ctx = EncodeContext(seed=3, step=5, shape=shape)
    whole = c.decode(c.encode(x, ctx), np.empty(n, np.float32))
    for step in {c.align(shape), unit}:
        cuts = [0, step, 3 * step, n] if 3 * step < n else [0, step, n]
        got = np.empty(n, np.float32)
        for lo, hi in zip(cuts, cuts[1:]):
            p = c.encode(x[lo:hi], EncodeContext(seed=3, step=5, offset=lo, shape=shape))
            c.decode(p, got[lo:hi])
        assert got.tobytes() == whole.tobytes()


@pytest.mark.parametrize("block", [2, 64, 1024])
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4097 * 3 + 5])
@pytest.mark.parametrize("has_e", [False, True])
def test_fused_feedback_is_encode_decode_subtract(block, n, has_e):
    c = hpccomm.get_codec("qsgd", bits=2, rotate=True, rotate_block=block)
    x = data(n, seed=1, heavy=True)
    e = data(n, seed=2) if has_e else None
    ctx = EncodeContext(seed=5, step=2, offset=3, feedback=True)
    e_out = np.full(n, np.nan, np.float32)
    p = c.encode_with_feedback(x, e, e_out, ctx)
    v = x + e if has_e else x
    want = c.encode(v, ctx)
    assert p.tobytes() == want.tobytes()
    want_e = v - c.decode(want, np.empty(n, np.float32))
    assert e_out.tobytes() == want_e.tobytes()


def test_nonfinite_and_overflow():
    c = hpccomm.get_codec("fp8", rotate=True, rotate_block=8)
    x = data(20)
    x[3] = np.inf
    with pytest.raises(NonFiniteError, match="input holds 1 NaN/Inf"):
        c.encode(x)
    big = np.full(16, 3e38, np.float32)       # finite, but H sums overflow
    with pytest.raises(NonFiniteError, match="overflows float32 at"):
        c.encode(big, EncodeContext(finite=True))
    p = hpccomm.get_codec("fp8", rotate=True, rotate_block=8, nonfinite="propagate")
    out = p.decode(p.encode(x), np.empty(20, np.float32))
    assert np.isnan(out[:8]).all() and np.isfinite(out[8:]).all()  # its piece only


def _bad(c, packet, n):
    with pytest.raises(PacketError):
        c.decode(packet, np.empty(n, np.float32))


def test_malformed_packets_raise():
    n = 1000
    c = hpccomm.get_codec("qsgd", rotate=True, rotate_block=64)
    p = c.encode(data(n))
    c.decode(p, np.empty(n, np.float32))
    _bad(c, p[:-1], n)
    _bad(c, np.concatenate([p, p[:1]]), n)
    _bad(c, p[:PREFIX + 3], n)                  # no inner header
    _bad(c, p[:PREFIX - 1], n)
    _bad(c, p, n + 1)
    for k in (0, 17, 255):
        q = p.copy()
        q[4] = k
        _bad(c, q, n)
    q = p.copy()
    q[5] = 3                                    # wraps onebit's id
    _bad(c, q, n)
    q = p.copy()
    q[PREFIX + 3] = 3                           # the inner header's codec id
    _bad(c, q, n)
    q = p.copy()
    q[PREFIX + 8] ^= 1                          # the inner header's n
    _bad(c, q, n)
    q = p.copy()
    q[PREFIX + 7] = 0x50                        # the inner bit width (5)
    _bad(c, q, n)
    with pytest.raises(PacketError, match="codec id 5, expected 13"):
        c.decode(hpccomm.get_codec("qsgd").encode(data(n)), np.empty(n, np.float32))


@pytest.mark.parametrize("name,params", [("qsgd", {"bits": 8, "bucket": 100}), ("onebit", {}),
                                         ("fp8", {"format": "e5m2"}), ("bf16", {})])
def test_fuzzed_packets_raise_or_decode_safely(name, params):
    """Random byte changes in the header, key and inner header, and random
    lengths: a PacketError, or a decode of the right length (the key and
    payload bytes may hold any value)."""
    n = 777
    c = hpccomm.get_codec(name, rotate=True, rotate_block=32, nonfinite="propagate", **params)
    p = c.encode(data(n), EncodeContext(shape=(n,)))
    rng = np.random.default_rng(0)
    decoded = 0
    for _ in range(300):
        q = p.copy()
        for i in rng.integers(0, PREFIX + 24, size=rng.integers(1, 4)):
            q[i] = rng.integers(0, 256)
        if rng.random() < 0.2:
            q = q[:rng.integers(0, q.size + 1)]
        try:
            out = c.decode(q, np.empty(n, np.float32))
        except PacketError:
            continue
        decoded += 1
        assert out.size == n
    assert 0 < decoded < 300


def test_options_and_refusals():
    c = hpccomm.get_codec("qsgd", bits=2, rotate=True, rotate_block=64)
    assert isinstance(c, RotatedCodec) and c.name == "qsgd+rotate"
    assert c.params() == {"bits": 2, "bucket": 512, "norm": "l2", "rotate": True,
                          "rotate_block": 64}
    assert c.describe() == "qsgd+rotate(bits=2,bucket=512,norm=l2,rotate=True,rotate_block=64)"
    assert hpccomm.get_codec("qsgd+rotate", bits=2, rotate_block=64).describe() == c.describe()
    assert type(hpccomm.get_codec("qsgd", rotate=False)).__name__ == "QSGDCodec"
    assert not c.summable and c.stochastic and hpccomm.get_codec("onebit+rotate").biased
    for name in ("topk", "dgc", "randk", "threshold", "adaptive"):
        with pytest.raises(ValueError, match="needs a dense lossy codec.*not a dense quantizer"):
            hpccomm.get_codec(name, rotate=True)
    with pytest.raises(ValueError, match="'none' is lossless"):
        hpccomm.get_codec("none", rotate=True)
    with pytest.raises(ValueError, match="'powersgd' is reduced by an algorithm of its own"):
        hpccomm.get_codec("powersgd", rotate=True)
    with pytest.raises(ValueError, match="'ebq' is bounded per element"):
        hpccomm.get_codec("ebq", rotate=True)
    for block in (0, 1, 3, 1000, 1 << 17, 2.0, True, "64"):
        with pytest.raises(ValueError, match="rotate_block must be a power of two"):
            hpccomm.get_codec("qsgd", rotate=True, rotate_block=block)
    with pytest.raises(ValueError, match="rotate_block needs rotate=True"):
        hpccomm.get_codec("qsgd", rotate_block=64)
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="rotate must be True or False"):
            hpccomm.get_codec("qsgd", rotate=bad, rotate_block=64)
    with pytest.raises(ValueError, match="the name asks for rotate=True"):
        hpccomm.get_codec("qsgd+rotate", rotate=False)
    with pytest.raises(ValueError, match="already rotated"):
        RotatedCodec(c)
    # option routing: every codec name takes them; scoped to the base name too
    assert {"rotate", "rotate_block"} <= option_names("qsgd")[0] <= option_names("qsgd+rotate")[0]
    assert resolve_options("qsgd+rotate", "twoshot", {"qsgd.bits": 2, "rotate_block": 64}) == (
        {"bits": 2, "rotate_block": 64}, {})
    r = hpccomm.Allreducer(MPI.COMM_SELF, codec="qsgd", algorithm="twoshot", rotate=True,
                           rotate_block=64, bits=2)
    assert r.codec.describe() == c.describe() and "rotate=True" in r.describe()
    x = data(500)
    np.testing.assert_array_equal(r(x, key="k"), hpccomm.reference.simulate(
        c, "twoshot", [x], seed=r.seed))
    with pytest.raises(ValueError, match="summable only with rotate=False"):
        hpccomm.Allreducer(MPI.COMM_SELF, codec="qsgd", algorithm="summable",
                           rotate=True)(x, key="k")
    with pytest.raises(ValueError, match="needs a dense lossy codec"):
        hpccomm.Allreducer(MPI.COMM_SELF, codec="topk", rotate=True)(x, key="k")


def test_error_model_is_the_inner_codecs():
    for name in ("qsgd", "onebit", "fp8"):
        a = reference.error_band(hpccomm.get_codec(name, rotate=True), "twoshot", 3, 2000)
        b = reference.error_band(hpccomm.get_codec(name), "twoshot", 3, 2000)
        assert a is not None and (a.gain, a.rel) == (b.gain, b.rel)


def rel_l2(codec, x, seed):
    y = codec.roundtrip(x, EncodeContext(seed=seed))
    return float(np.linalg.norm((y - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64)))


def test_rotation_halves_qsgd4_max_norm_error_on_student_t():
    """The target: rotation cuts qsgd-4's relative L2 error on Student-t
    (nu = 3) input by >= 2x -- with the max norm, whose level spacing follows
    the bucket's largest entry (measured 0.50 -> 0.19, 2.7x, 2^20 elements).
    With the l2 norm the spacing follows the bucket's norm, which a heavy
    tail does not inflate relative to ``||x||``: rotation does not help
    there (measured 1.12 -> 1.26) and is not asserted.  On Gaussian input
    the rotation changes nothing (within 2 %)."""
    x = data(1 << 20, seed=11, heavy=True)
    plain = rel_l2(hpccomm.get_codec("qsgd", bits=4, norm="max"), x, 1)
    rot = rel_l2(hpccomm.get_codec("qsgd", bits=4, norm="max", rotate=True), x, 1)
    print(f"qsgd-4 max, Student-t 3: plain {plain:.4f}, rotated {rot:.4f}")
    assert plain >= 2.0 * rot
    g = data(1 << 18, seed=12)
    for kw in ({"norm": "max"}, {}):
        a = rel_l2(hpccomm.get_codec("qsgd", bits=4, **kw), g, 2)
        b = rel_l2(hpccomm.get_codec("qsgd", bits=4, rotate=True, **kw), g, 2)
        assert abs(a / b - 1) < 0.02, (kw, a, b)


def test_device_path_stages_a_rotated_codec():
    """No device twin has a rotated codec's name: device input stages the
    gradient, with the reason (the plain twin must not run it)."""
    from hpccomm.collectives.on_device import why_not_on_device

    r = hpccomm.Allreducer(MPI.COMM_SELF, codec="qsgd", algorithm="twoshot", rotate=True)
    r(data(100), key="k")
    assert why_not_on_device(r.algorithm, r.codec, r.memory, "float32") == \
        "codec 'qsgd+rotate' has no device twin"
    plain = hpccomm.Allreducer(MPI.COMM_SELF, codec="qsgd", algorithm="twoshot")
    plain(data(100), key="k")
    assert why_not_on_device(plain.algorithm, plain.codec, plain.memory, "float32") == ""


def fwht_stages(v):
    """The transform of the kernels' module docstring in numpy float32, stage
    by stage (``h = 1, 2, ..., s/2``, butterflies ``(a + b, a - b)``): the
    order the kernels must keep, so their bits are these."""
    b = np.array(v, dtype=np.float32)
    h = 1
    with np.errstate(over="ignore", invalid="ignore"):
        while h < b.size:
            r = b.reshape(-1, 2, h)
            a, c = r[:, 0].copy(), r[:, 1].copy()
            r[:, 0] = a + c
            r[:, 1] = a - c
            h *= 2
    return b


def exact(x, e, q, d, block):
    """Float32 references of rotate (with its non-finite counts), unrotate
    and unrotate_residual, piece by piece with :func:`fwht_stages`."""
    n = x.size
    with np.errstate(invalid="ignore"):
        v = x if e is None else x + e
    y = np.empty(n, np.float32)
    un = np.empty(n, np.float32)
    res = np.empty(n, np.float32)
    bad_in = bad_out = 0
    lo = 0
    for s in K.piece_sizes(n, block):
        c = np.float32(1.0 / math.sqrt(s))
        sl = slice(lo, lo + s)
        y[sl] = c * fwht_stages(d[:s] * v[sl])
        nb = int((~np.isfinite(v[sl])).sum())
        bad_in += nb
        bad_out += int((~np.isfinite(y[sl])).sum()) if nb == 0 else 0
        un[sl] = d[:s] * (c * fwht_stages(q[sl]))
        with np.errstate(invalid="ignore"):
            res[sl] = v[sl] - un[sl]
        lo += s
    return y, (bad_in, bad_out), un, res


def same_bits(a, b):
    """Equal bits, NaN payloads aside (a NaN's payload follows operand order)."""
    nan = np.isnan(a)
    return (nan == np.isnan(b)).all() and a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("block", [2, 8, 16, 32, 64, 128, 1024, 2048])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 48, 1000, 2047, 2048 * 3 + 1023])
def test_kernels_give_the_bits_of_the_stage_order(block, n):
    """rotate / unrotate / unrotate_residual, whatever their loop structure
    (fused stages, the first and last stages fused with the loads and
    stores), give the float32 bits of the stage-by-stage transform, on
    heavy-tailed values, values near the float32 maximum and non-finite ones."""
    rng = np.random.default_rng(block * 7919 + n)
    d = signs(step=n, block=block)
    for case in range(3):
        x = data(n, seed=block + case, heavy=True) * np.float32(10.0 ** rng.integers(-30, 30))
        e = data(n, seed=block + case + 1)
        q = data(n, seed=block + case + 2, heavy=True)
        if case == 1 and n:
            x[rng.integers(0, n, 3)] = np.float32(3e38)
        if case == 2 and n:
            x[rng.integers(0, n, 2)] = [np.inf, np.nan][rng.integers(0, 2)]
            e[rng.integers(0, n)] = -np.inf
        for has_e in (False, True):
            want_y, want_bad, want_un, want_res = exact(x, e if has_e else None, q, d, block)
            y = np.empty(n, np.float32)
            assert K.rotate(x, e if has_e else x, has_e, d, block, y) == want_bad
            assert same_bits(y, want_y)
            res = q.copy()
            K.unrotate_residual(x, e if has_e else x, has_e, res, d, block, res)
            assert same_bits(res, want_res)
        un = np.empty(n, np.float32)
        K.unrotate(q, d, block, un, False)
        assert same_bits(un, want_un)
        acc = e.copy()
        K.unrotate(q, d, block, acc, True)
        assert same_bits(acc, e + want_un)
        K.unrotate(q, d, block, q, False)      # in place
        assert same_bits(q, want_un)
