"""Device twins of the dense quantizing codecs (:mod:`hpccomm.device_codecs`:
fp16, bf16, onebit, terngrad, qsgd) against the host codecs, on numba's CUDA
simulator.

Each check runs in a process of its own with ``NUMBA_ENABLE_CUDASIM=1`` (see
``tests/test_cuda_sim.py``) and demands, bit for bit:

* ``encode_with_feedback(x, e, e_out, ctx)``: the packet of the host's
  ``codec.encode(v, ctx')`` (``v = x + e``, ``ctx'`` with ``fresh=x`` under
  feedback) and of the host's fused ``encode_with_feedback``; ``e_out = v -
  decode``;
* ``owner_step`` on 1, 2, 3 (and 5: a group summed first) host-encoded
  packets: the host's three steps (rank-order ``decode_add`` from zeros, ``+
  e``, ``reencode``, residual, decode) and the host's fused ``owner_step``;
* ``decode`` and ``decode(add=True)`` into a non-zero ``out``;
* the fused methods against the base class's three device steps;
* NaN / Inf: :class:`~hpccomm.errors.NonFiniteError` under
  ``nonfinite="raise"``, the host's very bytes under ``"propagate"``.

The simulator runs each CUDA thread's code in Python: inputs stay small.
"""
import functools
import warnings
from dataclasses import replace

import numpy as np
import pytest

from .cudasim import run_check

SIZES = [0, 1, 7, 33, 203]


_run = functools.partial(run_check, "test_cuda_device_codecs")


# ---------------------------------------------------------------------------
# helpers (inside the simulator subprocess)
# ---------------------------------------------------------------------------
def _setup():
    from numba import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    # the simulator runs the uint64 hash on numpy scalars, which warn on wraparound
    warnings.simplefilter("ignore", RuntimeWarning)


def _contexts():
    from hpccomm.codecs.base import EncodeContext

    return [EncodeContext(seed=5, rank=2, step=9, offset=13),
            EncodeContext(seed=11, rank=0, step=1, offset=1000, feedback=True)]


def _data(n, seed, scale=1.0):
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    if n > 6:
        x[5], x[6] = 0.0, -0.0
    if n > 20:
        x[20] = x[19]          # a tie or two for the rounding codecs
    return x


def _order_sensitive(kind):
    """Inputs whose float32 statistic depends on the order of the float64
    sums (random float32 data sums exactly in float64 and cannot tell
    orders apart): the large values put the result on a float32 rounding
    midpoint, and tiny ones tip it only when the CPU's lanes and lane tree
    sum them before they meet the large ones (a sequential sum drops them).

    * ``"onebit"``: a column of 64 entries >= 0 (mean 0.875 + 2**-25 plus
      eight 2**-50 in lanes 0, 8, ..., 56), after a random column and
      before its negative;
    * ``"qsgd"``: an l2 bucket of 33 (``sum v**2 = (1 + 2**-24)**2`` plus
      eight ``(2**-27)**2`` in lanes 0, 4, ..., 28), likewise;
    * ``"terngrad"``: 1000 plus multiples of 2**-14, whose variance only
      the shifted moments (``v - v[0]``) keep."""
    rng = np.random.default_rng(21)
    if kind == "terngrad":
        return (1000 + rng.integers(-20, 21, 96) * 2.0 ** -14).astype(np.float32)
    if kind == "onebit":
        col = np.ones(64, np.float32)
        col[3] = 1 + 2.0 ** -19
        col[::8] = 2.0 ** -50
    else:
        col = np.zeros(33, np.float32)
        col[[1, 3, 5, 7]] = 1, 2.0 ** -12, 2.0 ** -12, 2.0 ** -24
        col[0:32:4] = 2.0 ** -27
    return np.concatenate([rng.standard_normal(col.size).astype(np.float32), col, -col])


def _same(a, b):
    """Bitwise equality of float32 / uint8 arrays (NaN payloads included)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:
        a, b = a.view(np.uint32), b.view(np.uint32)
    return a.shape == b.shape and np.array_equal(a, b)


class _Twin:
    """A host codec and its twin, with numpy in and out."""

    def __init__(self, codec):
        from hpccomm.device_codecs import device_codec_for

        self.codec = codec
        self.dev = device_codec_for(codec)
        assert self.dev is not None, codec

    @staticmethod
    def put(a):
        from numba import cuda

        return None if a is None else cuda.to_device(np.ascontiguousarray(a))

    @staticmethod
    def get(a):
        from hpccomm.kernels import cuda_util as U

        return U.to_host(a)

    def encode(self, x, e, with_eout, ctx):
        """``(packet, e_out)`` of the twin's ``encode_with_feedback``."""
        e_out = self.put(np.full(x.size, 7.0, np.float32)) if with_eout else None
        packet = self.get(self.dev.encode_with_feedback(self.put(x), self.put(e), e_out, ctx))
        return packet, (None if e_out is None else self.get(e_out))

    def owner(self, packets, e, with_eout, ctx):
        """``(packet, e_out, out)`` of the twin's ``owner_step``."""
        m = int(packets[0][8:16].view(np.uint64)[0]) if packets else 0
        return self.owner_m(packets, e, with_eout, ctx, m)

    def owner_m(self, packets, e, with_eout, ctx, m):
        e_out = self.put(np.full(m, 7.0, np.float32)) if with_eout else None
        out = self.put(np.full(m, -3.0, np.float32))
        packet = self.get(self.dev.owner_step([self.put(p) for p in packets], self.put(e), e_out,
                                              out, ctx))
        return packet, (None if e_out is None else self.get(e_out)), self.get(out)


def _v(x, e):
    return x if e is None else x + e


def _check_encode(t, x, e, ctx):
    """Encode with and without ``e_out`` against the host."""
    codec = t.codec
    v = _v(x, e)
    ref = codec.encode(v, replace(ctx, fresh=x) if ctx.feedback else ctx)
    packet, _ = t.encode(x, e, False, ctx)
    assert _same(packet, ref), ("encode", codec, x.size, ctx)
    packet, e_out = t.encode(x, e, True, ctx)
    assert _same(packet, ref), ("encode_with_feedback", codec, x.size, ctx)
    assert _same(e_out, v - codec.decode(ref, np.empty(x.size, np.float32))), \
        ("e_out", codec, x.size, ctx)
    host_eout = np.empty(x.size, np.float32)
    host = codec.encode_with_feedback(x, e, host_eout, ctx)
    assert _same(packet, host) and _same(e_out, host_eout), ("host fused", codec, x.size, ctx)
    return ref


def _check_decode(t, packet, n, seed):
    codec = t.codec
    out = t.put(np.full(n, 5.0, np.float32))
    t.dev.decode(t.put(packet), out)
    assert _same(t.get(out), codec.decode(packet, np.empty(n, np.float32))), ("decode", codec)
    base = _data(n, seed)
    out = t.put(base)
    t.dev.decode(t.put(packet), out, add=True)
    assert _same(t.get(out), codec.decode_add(packet, base.copy())), ("decode add", codec)


def _reference_owner(codec, packets, e, with_eout, ctx, m):
    """The host's three steps: ``(packet, e_out, out)``."""
    acc = np.zeros(m, np.float32)
    for p in packets:
        codec.decode_add(p, acc)
    w = _v(acc, e)
    octx = replace(ctx, fresh=acc.copy()) if ctx.feedback and with_eout else ctx
    packet = codec.reencode(w, octx)
    d = codec.decode(packet, np.empty(m, np.float32))
    return packet, (w - d if with_eout else None), d


def _check_owner(t, packets, e, with_eout, ctx, m):
    codec = t.codec
    ref = _reference_owner(codec, packets, e, with_eout, ctx, m)
    got = t.owner_m(packets, e, with_eout, ctx, m)
    what = ("owner_step", codec, m, len(packets), e is not None, with_eout, ctx)
    assert _same(got[0], ref[0]), what
    assert (got[1] is None) == (ref[1] is None) and (got[1] is None or _same(got[1], ref[1])), what
    assert _same(got[2], ref[2]), what
    if e is None or with_eout:     # the host's fused step leaves e out without e_out
        h_eout = np.empty(m, np.float32) if with_eout else None
        h_out = np.empty(m, np.float32)
        host = codec.owner_step(packets, e, h_eout, h_out, ctx)
        assert _same(got[0], host) and _same(got[2], h_out), ("host " + what[0],) + what[1:]
        assert h_eout is None or _same(got[1], h_eout), what


def _check_base_path(t, x, e, packets, ctx):
    """The twin's fused methods against the base class's three steps on the
    device (its ``_encode``, ``_decode_into`` with subtract, ``reencode``)."""
    from hpccomm.device_codecs.base import DeviceCodec

    n = x.size
    fused = t.encode(x, e, True, ctx)
    e_out = t.put(np.zeros(n, np.float32))
    packet = t.get(DeviceCodec.encode_with_feedback(t.dev, t.put(x), t.put(e), e_out, ctx))
    assert _same(packet, fused[0]) and _same(t.get(e_out), fused[1]), ("base path", t.codec)
    fused = t.owner_m(packets, e, True, ctx, n)
    e_out, out = t.put(np.zeros(n, np.float32)), t.put(np.zeros(n, np.float32))
    packet = t.get(DeviceCodec.owner_step(t.dev, [t.put(p) for p in packets], t.put(e), e_out,
                                          out, ctx))
    assert _same(packet, fused[0]) and _same(t.get(e_out), fused[1]) \
        and _same(t.get(out), fused[2]), ("base owner path", t.codec)


def _sweep(codec, sizes=SIZES, ctx_for=None, big=None):
    """Encode, owner step and decode of ``codec`` for each size: e None /
    random, e_out None / a buffer, the contexts in turn, 1-3 received packets
    (5 at one size)."""
    t = _Twin(codec)
    contexts = _contexts()
    for idx, n in enumerate(sizes):
        ctx = contexts[idx % 2]
        if ctx_for is not None:
            ctx = ctx_for(ctx, n)
        x = _data(n, n)
        e = _data(n, 1000 + n, 0.25)
        _check_encode(t, x, None, ctx)
        ref = _check_encode(t, x, e, ctx)
        _check_decode(t, ref, n, 77 + n)
        nrecv = 5 if idx == 3 else 1 + idx % 3
        packets = [codec.encode(_data(n, 10 * k + n), replace(ctx, rank=k, feedback=False))
                   for k in range(nrecv)]
        for e_, with_eout in ((None, False), (e, True), (None, True), (e, False)):
            _check_owner(t, packets, e_, with_eout, ctx, n)
        if idx == 3:
            _check_base_path(t, x, e, packets, ctx)
    if big:
        n = big
        ctx = contexts[1] if ctx_for is None else ctx_for(contexts[1], n)
        x, e = _data(n, 3), _data(n, 4, 0.25)
        ref = _check_encode(t, x, e, ctx)
        _check_decode(t, ref, n, 5)
        packets = [codec.encode(_data(n, 6 + k), replace(ctx, rank=k)) for k in range(2)]
        _check_owner(t, packets, e, True, ctx, n)


def _check_nonfinite(codec_name, **params):
    """NaN / Inf: raised under ``raise`` (encode, encode_with_feedback, owner
    step; skipped for ``ctx.finite`` input without ``e``), the host's bytes
    under ``propagate``."""
    import hpccomm
    from hpccomm.errors import NonFiniteError

    ctx = _contexts()[1]
    n = 40
    t = _Twin(hpccomm.get_codec(codec_name, **params))
    for bad in (np.nan, np.inf, -np.inf):
        x = _data(n, 8)
        x[11] = bad
        for with_eout in (False, True):
            with pytest.raises(NonFiniteError):
                t.encode(x, None, with_eout, ctx)
        x = _data(n, 8)
        e = np.zeros(n, np.float32)
        e[30] = bad
        with pytest.raises(NonFiniteError):
            t.encode(x, e, True, replace(ctx, finite=True))      # x finite, v is not
        packets = [t.codec.encode(_data(n, 9), ctx)]
        with pytest.raises(NonFiniteError):
            t.owner(packets, e, True, ctx)
    x = _data(n, 8)
    x[3] = np.inf
    t.encode(x, None, True, replace(ctx, finite=True))          # trusted: no scan
    p = _Twin(hpccomm.get_codec(codec_name, nonfinite="propagate", **params))
    for bad in (np.nan, np.inf, -np.inf):
        for ctx_ in _contexts():
            x = _data(n, 12)
            x[7] = bad
            e = _data(n, 13, 0.25)
            _check_encode(p, x, e, ctx_)
            packets = [p.codec.encode(x, ctx_), p.codec.encode(_data(n, 14), ctx_)]
            _check_owner(p, packets, e, True, ctx_, n)
            _check_owner(p, packets[1:], np.where(np.arange(n) == 2, bad, e).astype(np.float32),
                         True, ctx_, n)
            _check_decode(p, packets[0], n, 15)


# ---------------------------------------------------------------------------
# checks (run inside the simulator subprocess)
# ---------------------------------------------------------------------------
def check_half_bits():
    """The integer fp16 / bf16 roundings of the device kernels, compiled for
    the CPU, against halfwidth's kernels: every float32 exponent and sign with
    the low mantissa bits around each rounding boundary, and random patterns;
    every half bit pattern widened."""
    _setup()
    from numba import njit

    from hpccomm.kernels import cuda_quantize as Q
    from hpccomm.kernels import halfwidth as K

    f16, bf16, widen = njit(Q.f16_round), njit(Q.bf16_round), njit(Q.f16_value_bits)

    @njit
    def apply(fn, u, out):
        for i in range(u.size):
            out[i] = fn(u[i])

    high = np.arange(1 << 20, dtype=np.uint32) << np.uint32(12)
    lows = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
    u = np.concatenate([(high[:, None] | lows[None, :]).ravel(),
                        np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    got, ref = np.empty(u.size, np.uint16), np.empty(u.size, np.uint16)
    apply(f16, u, got)
    K.f32_to_f16(u, ref)
    assert np.array_equal(got, ref), np.flatnonzero(got != ref)[:5]
    apply(bf16, u, got)
    K.f32_to_bf16(u, ref, True)
    assert np.array_equal(got, ref), np.flatnonzero(got != ref)[:5]
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits, ref = np.empty(h.size, np.uint32), np.empty(h.size, np.float32)
    apply(widen, h, bits)
    K.f16_to_f32(h, ref, False)
    assert np.array_equal(bits, ref.view(np.uint32))


def check_halfwidth():
    _setup()
    import hpccomm

    for name in ("fp16", "bf16"):
        scale = 3e4 if name == "fp16" else 1.0
        codec = hpccomm.get_codec(name)
        _sweep(codec, big=1000)
        # large and tiny magnitudes: saturation and subnormals
        t = _Twin(codec)
        x = _data(203, 1, scale) * np.float32(4.0)
        x[:8] = [65504, 65519.99, 65520, -1e6, 3e-8, 2.9802322e-08, 6e-5, -1e-45]
        _check_encode(t, x, _data(203, 2, scale * 1e-3), _contexts()[0])
        _check_nonfinite(name)


def check_onebit():
    _setup()
    import hpccomm

    for col_len, shape in ((None, ()), (None, (-1, 64)), (1, ()), (5, ()), (37, ())):
        def ctx_for(ctx, n, shape=shape):
            return replace(ctx, shape=(max(n, 1) // 64 + 1, 64) if shape else shape)

        codec = hpccomm.get_codec("onebit", col_len=col_len)
        _sweep(codec, ctx_for=ctx_for, big=1000 if col_len in (None, 37) else None)
    t = _Twin(hpccomm.get_codec("onebit", col_len=64))
    for ctx in _contexts():
        _check_encode(t, _order_sensitive("onebit"), None, ctx)
    _check_nonfinite("onebit", col_len=5)
    _check_nonfinite("onebit", col_len=32)


def check_terngrad():
    _setup()
    import hpccomm

    for clip in (2.5, None):
        _sweep(hpccomm.get_codec("terngrad", clip=clip), big=1000 if clip else None)
    # constant and all-zero input: sigma == 0 and s == 0; a large mean
    t = _Twin(hpccomm.get_codec("terngrad"))
    for ctx in _contexts():
        _check_encode(t, _order_sensitive("terngrad"), None, ctx)
        _check_encode(t, np.full(50, 0.75, np.float32), None, ctx)
        _check_encode(t, np.zeros(50, np.float32), np.zeros(50, np.float32), ctx)
    _check_nonfinite("terngrad")


def check_qsgd():
    _setup()
    import hpccomm

    for bits, bucket, norm in ((2, 7, "l2"), (4, 7, "max"), (8, 7, "l2"), (2, 64, "max"),
                               (4, 512, "l2"), (2, 3, "l2")):
        codec = hpccomm.get_codec("qsgd", bits=bits, bucket=bucket, norm=norm)
        _sweep(codec, big=1000 if bucket in (7, 512) and bits != 8 else None)
    t = _Twin(hpccomm.get_codec("qsgd", bits=4, bucket=16))
    for ctx in _contexts():
        x = np.zeros(50, np.float32)
        x[20:] = 1e-3
        _check_encode(t, x, None, ctx)             # an all-zero bucket, then a constant one
    t = _Twin(hpccomm.get_codec("qsgd", bits=4, bucket=33))
    for ctx in _contexts():
        _check_encode(t, _order_sensitive("qsgd"), None, ctx)
    _check_nonfinite("qsgd", bits=4, bucket=16)
    _check_nonfinite("qsgd", bits=2, bucket=7, norm="max")


# ---------------------------------------------------------------------------
# tests (run the checks)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", ["check_half_bits", "check_halfwidth", "check_onebit",
                                   "check_terngrad", "check_qsgd"])
def test_device_codec_matches_host(check):
    _run(check)
