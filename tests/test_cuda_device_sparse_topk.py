"""Device twins of ``topk`` and ``dgc`` (:mod:`hpccomm.device_codecs.topk`,
:mod:`hpccomm.device_codecs.dgc`) against the host codecs' three-step
reference, on numba's CUDA simulator.

As in ``tests/test_cuda_sim.py``, each check runs in a process of its own with
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) and is skipped when
the simulator cannot start.  The checks demand the host's packet bytes, the
residual and decoded values bit for bit (compared as uint32 patterns), the
host's PacketError message for malformed packets with the target left
untouched, and NonFiniteError where the host raises it.

The simulator runs each CUDA thread's code in Python.  Inputs stay small;
the sampled-threshold path of ``topk`` (which needs ``n > 4096``) runs once
at ``n = 5000`` and otherwise with the host module's sample-size constants
lowered -- the twin takes ``s`` from the host codec, so both sides see the
same change.
"""
import functools
import warnings
from dataclasses import replace

import numpy as np
import pytest

from .cudasim import run_check

SIZES = [0, 1, 7, 33, 203, 2000]


_run = functools.partial(run_check, "test_cuda_device_sparse_topk")


def _setup():
    from numba import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    # the simulator runs the kernels on numpy scalars (inf - inf, uint64 wraparound warn)
    warnings.simplefilter("ignore", RuntimeWarning)


# ---------------------------------------------------------------------------
# inputs and the host reference
# ---------------------------------------------------------------------------
KINDS = ("gauss", "zeros", "ties", "equal", "discrete", "allzero")


def _data(kind, n, seed):
    """float32 inputs: Gaussian with +-0.0, mostly zeros, a few tied
    magnitudes, one magnitude everywhere (random signs), a small integer
    range, all zeros."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        x = rng.standard_normal(n).astype(np.float32)
        x[5:7] = [0.0, -0.0] if n > 6 else x[5:7]
    elif kind == "zeros":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.random(n) < 0.9] = 0.0
        x[rng.random(n) < 0.05] = -0.0
    elif kind == "ties":
        x = rng.choice(np.float32([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25]), n)
    elif kind == "equal":
        x = np.where(rng.random(n) < 0.5, np.float32(-1.5), np.float32(1.5))
    elif kind == "discrete":
        x = rng.integers(-3, 4, n).astype(np.float32)
    else:
        x = np.zeros(n, np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def _ctx(rng, feedback=False):
    from hpccomm.codecs.base import EncodeContext

    return EncodeContext(seed=int(rng.integers(1 << 31)), rank=int(rng.integers(8)),
                         step=int(rng.integers(1000)), offset=int(rng.integers(100000)),
                         feedback=feedback)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), what


def _decoded(codec, packet, n):
    return codec.decode(packet, np.empty(n, np.float32))


def _dev(codec):
    from hpccomm.device_codecs import device_codec_for

    dev = device_codec_for(codec)
    assert dev is not None and type(dev).__name__.lower().startswith(codec.name)
    return dev


def _host_feedback(codec, x, e, with_residual, ctx):
    """The three steps: ``v = x + e``, the packet of ``v`` under ``ctx'``,
    ``e_out = v - decode(packet)``."""
    v = x if e is None else x + e
    ectx = replace(ctx, fresh=x) if ctx.feedback and with_residual else ctx
    packet = codec.encode(v, ectx)
    residual = v - _decoded(codec, packet, x.size) if with_residual else None
    return packet, residual


def _check_feedback(codec, x, e, with_residual, ctx, what):
    """The twin's ``encode_with_feedback`` against the host: packet bytes,
    residual bits, inputs untouched."""
    from numba import cuda

    dev = _dev(codec)
    packet, residual = _host_feedback(codec, x, e, with_residual, ctx)
    dx = cuda.to_device(x)
    de = None if e is None else cuda.to_device(e)
    dout = cuda.to_device(np.full(x.size, 7.0, np.float32)) if with_residual else None
    got = dev.encode_with_feedback(dx, de, dout, ctx).copy_to_host()
    _same(got, packet, f"packet {what}")
    if with_residual:
        _same(dout.copy_to_host(), residual, f"residual {what}")
    _same(dx.copy_to_host(), x, f"x changed {what}")
    if e is not None:
        _same(de.copy_to_host(), e, f"e changed {what}")
    return packet


def _host_owner(codec, received, e, with_residual, ctx, n):
    """Twoshot's step 4 in three steps: decode-add in rank order from zero,
    ``w = acc + e``, ``reencode``, ``e_out = w - decode``, ``out = decode``."""
    acc = np.zeros(n, np.float32)
    for p in received:
        codec.decode_add(p, acc)
    w = acc if e is None else acc + e
    octx = replace(ctx, fresh=acc) if with_residual and ctx.feedback else ctx
    packet = codec.reencode(w, octx)
    out = _decoded(codec, packet, n)
    return packet, (w - out if with_residual else None), out


def _check_owner(codec, received, e, with_residual, ctx, n, what):
    from numba import cuda

    dev = _dev(codec)
    packet, residual, out = _host_owner(codec, received, e, with_residual, ctx, n)
    dpk = [cuda.to_device(p) for p in received]
    de = None if e is None else cuda.to_device(e)
    dres = cuda.to_device(np.full(n, 3.0, np.float32)) if with_residual else None
    dout = cuda.to_device(np.full(n, 5.0, np.float32))
    got = dev.owner_step(dpk, de, dres, dout, ctx).copy_to_host()
    _same(got, packet, f"owner packet {what}")
    _same(dout.copy_to_host(), out, f"owner out {what}")
    if with_residual:
        _same(dres.copy_to_host(), residual, f"owner residual {what}")
    if e is not None:
        _same(de.copy_to_host(), e, f"owner e changed {what}")


def _feedback_cases(codec, sizes, per_size, seed):
    """``per_size`` input kinds for every size (rotating through
    :data:`KINDS`), cycling through feedback on/off, e None/random, e_out
    None/buffer and a fresh context."""
    rng = np.random.default_rng(seed)
    c = seed
    for si, n in enumerate(sizes):
        for j in range(per_size if n < 1000 else 1):
            kind = KINDS[(seed + si + j) % len(KINDS)]
            x = _data(kind, n, int(rng.integers(1 << 30)))
            e = None
            if c % 4 in (1, 3):
                e = (_data(kind if kind in ("ties", "discrete") else "gauss", n,
                           int(rng.integers(1 << 30))) * np.float32(0.5)).astype(np.float32)
            with_residual = c % 4 in (0, 1) or c % 7 == 0
            ctx = _ctx(rng, feedback=c % 3 != 0)
            _check_feedback(codec, x, e, with_residual, ctx,
                            f"{codec.describe()} n={n} {kind} e={e is not None} "
                            f"res={with_residual} {ctx}")
            c += 1


# ---------------------------------------------------------------------------
# checks (run inside the simulator subprocess)
# ---------------------------------------------------------------------------
def check_topk_encode():
    """topk at ratios 0.01 / 0.1 / 0.5 / 1.0, exact False / True: packets and
    residuals for every input kind, n up to 2000 (s == n: the exact k-th
    largest by radix select)."""
    _setup()
    import hpccomm

    for i, (ratio, exact) in enumerate([(0.01, False), (0.1, True), (0.5, False), (1.0, True),
                                        (0.01, True), (0.1, False), (0.5, True), (1.0, False)]):
        codec = hpccomm.get_codec("topk", ratio=ratio, exact=exact)
        _feedback_cases(codec, SIZES if i < 4 else SIZES[:-1], 3, seed=10 + i)


def check_topk_sampled():
    """topk's sampled threshold (s < n): at n = 5000 as shipped, and at
    small n with the host module's sample sizes lowered; inputs where the
    sample overshoots so that ``exact=True`` falls back to the exact k-th
    largest, and where far more than k pass (the cut, with ties)."""
    _setup()
    import hpccomm
    from hpccomm.codecs import topk as T
    from hpccomm.device_codecs.topk import sample_start
    from hpccomm.kernels.rng import stream_key

    rng = np.random.default_rng(99)
    for exact in (False, True):
        codec = hpccomm.get_codec("topk", ratio=0.5, exact=exact)
        assert codec.sample_size(5000) < 5000
        x = _data("gauss", 5000, 1)
        _check_feedback(codec, x, None, True, _ctx(rng, True), f"n=5000 exact={exact}")
    T.MIN_SAMPLES, T.SAMPLED_HITS = 16, 2
    for ratio in (0.1, 0.5):
        for exact in (False, True):
            codec = hpccomm.get_codec("topk", ratio=ratio, exact=exact)
            for n in (33, 203, 2000):
                s = codec.sample_size(n)
                assert s < n, (ratio, n, s)
                kinds = ("gauss", "ties", "zeros", "overshoot") if n < 1000 else \
                    (("overshoot",) if exact else ("ties",))
                for kind in kinds:
                    ctx = _ctx(rng, feedback=bool(rng.integers(2)))
                    if kind == "overshoot":   # large values exactly where the sample looks
                        x = _data("gauss", n, n) * np.float32(1e-3)
                        key = stream_key(ctx.seed, ctx.rank, ctx.step, T.SALT)
                        start = sample_start(n, s, key, ctx.offset)
                        x[start:start + (n // s) * (s - 1) + 1:n // s] = 10.0
                        if s < codec.max_count(n) and not exact:   # fewer than k pass
                            assert codec.encode(x, ctx).size == T.pairs_size(n, s)
                    else:
                        x = _data(kind, n, int(rng.integers(1 << 30)))
                    e = None if kind != "gauss" else _data("gauss", n, 5) * np.float32(0.1)
                    _check_feedback(codec, x, e, bool(rng.integers(2)) or kind == "overshoot",
                                    ctx, f"ratio={ratio} exact={exact} n={n} s={s} {kind}")


def check_dgc_encode():
    """dgc for several (ratio, sample_ratio, max_iters): the sampled
    threshold, its decay (an input whose sample holds the only large values)
    and the cut of too many candidates."""
    _setup()
    import hpccomm
    from hpccomm.codecs import dgc as D
    from hpccomm.device_codecs.topk import sample_start
    from hpccomm.kernels.rng import stream_key

    params = [dict(), dict(ratio=0.1), dict(ratio=0.5, sample_ratio=0.2, max_iters=3),
              dict(ratio=0.05, sample_ratio=0.5, max_iters=0), dict(ratio=1.0)]
    for i, p in enumerate(params):
        codec = hpccomm.get_codec("dgc", **p)
        _feedback_cases(codec, SIZES if i < 3 else SIZES[:-1], 3 if i < 3 else 2, seed=40 + i)
    rng = np.random.default_rng(7)
    for p in params[1:3]:
        codec = hpccomm.get_codec("dgc", **p)
        for n in (203, 2000):
            ctx = _ctx(rng, True)
            s = D.dgc_sample_size(n, codec.ratio, codec.sample_ratio)
            key = stream_key(ctx.seed, ctx.rank, ctx.step, D.SALT)
            start = sample_start(n, s, key, ctx.offset)
            x = _data("gauss", n, n)
            x[start:start + (n // s) * (s - 1) + 1:n // s] = 4.0
            _check_feedback(codec, x, None, True, ctx, f"dgc decay {p} n={n}")


def check_owner_step():
    """owner_step with P = 1, 2, 3 host-encoded packets (both codecs, sizes
    up to 2000, every e / e_out combination)."""
    _setup()
    import hpccomm

    rng = np.random.default_rng(5)
    codecs = [hpccomm.get_codec("topk", ratio=0.1),
              hpccomm.get_codec("topk", ratio=0.5, exact=True),
              hpccomm.get_codec("dgc", ratio=0.1), hpccomm.get_codec("topk", ratio=1.0)]
    c = 0
    for codec in codecs:
        for n in (1, 7, 33, 203, 2000):
            P = 1 + c % 3
            kind = ("gauss", "ties", "zeros", "discrete")[c % 4]
            received = [codec.encode(_data(kind, n, int(rng.integers(1 << 30))), _ctx(rng))
                        for _ in range(P)]
            e = _data("gauss", n, c) * np.float32(0.3) if c % 2 else None
            with_residual = c % 4 < 2
            ctx = _ctx(rng, feedback=bool(c % 3))
            _check_owner(codec, received, e, with_residual, ctx, n,
                         f"{codec.describe()} n={n} P={P} {kind} e={e is not None} "
                         f"res={with_residual}")
            c += 1
    codec = hpccomm.get_codec("topk", ratio=0.1)
    _check_owner(codec, [], None, True, _ctx(rng, True), 0, "n=0 P=0")
    _check_owner(codec, [codec.encode(np.zeros(0, np.float32))], None, True, _ctx(rng), 0,
                 "n=0 P=1")


def _corruptions(codec, packet, n):
    """``(name, bad packet)`` variants of a valid pair packet with ``m >= 2``."""
    from hpccomm.codecs.sparsifier import index_dtype

    m = int(packet[4:8].view(np.uint32)[0])
    idt = index_dtype(n)
    b = idt.itemsize

    def with_idx(j, value):
        p = packet.copy()
        p[16 + b * j:16 + b * (j + 1)] = np.array([value], idt).view(np.uint8)
        return p

    def idx(j):
        return int(packet[16 + b * j:16 + b * (j + 1)].view(idt)[0])

    out = [("swap", with_idx(0, idx(1))), ("duplicate", with_idx(m - 1, idx(m - 2))),
           ("past the end", with_idx(m - 1, n)), ("negative", with_idx(0, -1)),
           ("huge", with_idx(m // 2, 2 ** 31 - 1))]
    p = packet.copy()
    p[4:8] = np.array([m + 1], np.uint32).view(np.uint8)
    out.append(("count above size", p))
    p = packet.copy()
    p[4:8] = np.array([m - 1], np.uint32).view(np.uint8)
    out.append(("count below size", p))
    p = packet[:-1].copy()
    out.append(("truncated", p))
    k = codec.max_count(n)
    over = np.empty(16 + (b + 4) * (k + 1), np.uint8)       # k + 1 valid entries
    over[:16] = packet[:16]
    over[4:8] = np.array([k + 1], np.uint32).view(np.uint8)
    over[16:16 + b * (k + 1)] = np.arange(k + 1, dtype=idt).view(np.uint8)
    over[16 + b * (k + 1):] = np.ones(k + 1, np.float32).view(np.uint8)
    out.append(("more than k", over))
    p = packet.copy()
    p[3] = 99
    out.append(("codec id", p))
    p = packet.copy()
    p[0] = ord("X")
    out.append(("magic", p))
    p = packet.copy()
    p[8:16] = np.array([n + 1], np.uint64).view(np.uint8)
    out.append(("n", p))
    return out


def check_decode_and_malformed():
    """decode / decode-add / owner_step against the host decoder; malformed
    packets raise the host's PacketError (same message) and leave the target
    (and the owner's residual) untouched."""
    _setup()
    import hpccomm
    from hpccomm.errors import PacketError
    from numba import cuda

    rng = np.random.default_rng(3)
    for name, params in (("topk", dict(ratio=0.1)), ("dgc", dict(ratio=0.5))):
        codec = hpccomm.get_codec(name, **params)
        dev = _dev(codec)
        for n in (0, 1, 33, 203):
            x = _data("gauss", n, n)
            packet = codec.encode(x, _ctx(rng))
            base = _data("gauss", n, 100 + n)
            for add in (False, True):
                d = cuda.to_device(base)
                dev.decode(cuda.to_device(packet), d, add=add)
                expect = base.copy()
                (codec.decode_add if add else codec.decode)(packet, expect)
                _same(d.copy_to_host(), expect, f"{name} decode add={add} n={n}")
            if n < 33:
                continue
            # the building blocks through the base class's unfused composition
            from hpccomm.device_codecs.base import DeviceCodec

            ctx = _ctx(rng, True)
            _same(dev._encode(cuda.to_device(x), ctx).copy_to_host(), codec.encode(x, ctx),
                  f"{name} _encode n={n}")
            e = _data("ties", n, 3)
            ref, residual = _host_feedback(codec, x, e, True, ctx)
            res = cuda.device_array(n, np.float32)
            got = DeviceCodec.encode_with_feedback(dev, cuda.to_device(x), cuda.to_device(e), res,
                                                   ctx)
            _same(got.copy_to_host(), ref, f"{name} base encode_with_feedback n={n}")
            _same(res.copy_to_host(), residual, f"{name} base residual n={n}")
            received = [codec.encode(_data("gauss", n, j), _ctx(rng)) for j in range(2)]
            ref, residual, out = _host_owner(codec, received, e, True, ctx, n)
            d = cuda.device_array(n, np.float32)
            got = DeviceCodec.owner_step(dev, [cuda.to_device(p) for p in received],
                                         cuda.to_device(e), res, d, ctx)
            _same(got.copy_to_host(), ref, f"{name} base owner_step n={n}")
            _same(res.copy_to_host(), residual, f"{name} base owner residual n={n}")
            _same(d.copy_to_host(), out, f"{name} base owner out n={n}")
            for what, bad in _corruptions(codec, packet, n):
                with pytest.raises(PacketError) as host_err:
                    codec.decode(bad, np.empty(n, np.float32))
                d = cuda.to_device(base)
                with pytest.raises(PacketError) as dev_err:
                    dev.decode(cuda.to_device(bad), d, add=bool(rng.integers(2)))
                assert str(dev_err.value) == str(host_err.value), (what, dev_err.value,
                                                                   host_err.value)
                _same(d.copy_to_host(), base, f"{name} out written for {what}")
                # the owner: every packet is checked before the sum starts
                good = codec.encode(_data("ties", n, 1), _ctx(rng))
                d = cuda.to_device(base)
                res = cuda.to_device(base)
                with pytest.raises(PacketError) as own_err:
                    dev.owner_step([cuda.to_device(good), cuda.to_device(bad)], None, res, d,
                                   _ctx(rng, True))
                assert str(own_err.value) == str(host_err.value), what
                _same(d.copy_to_host(), base, f"{name} owner out written for {what}")
                _same(res.copy_to_host(), base, f"{name} owner residual written for {what}")


def check_nonfinite():
    """NaN / Inf under nonfinite="raise" raise NonFiniteError (encode, with
    feedback, owner step); ``ctx.finite`` skips the scan as the host does;
    under "propagate" the packets and residuals are the host's bits."""
    _setup()
    import hpccomm
    from hpccomm.errors import NonFiniteError
    from numba import cuda

    rng = np.random.default_rng(11)
    c = 0
    for name, params in (("topk", dict(ratio=0.1)), ("topk", dict(ratio=0.5, exact=True)),
                         ("dgc", dict(ratio=0.2))):
        codec = hpccomm.get_codec(name, **params)
        dev = _dev(codec)
        for n, bad in ((7, np.nan), (203, np.inf)):
            x = _data("gauss", n, n)
            x[n // 2] = bad
            with pytest.raises(NonFiniteError) as host_err:
                codec.encode(x, _ctx(rng))
            for _ in range(2):
                e = None if c % 2 else np.ones(n, np.float32)
                e_out = None if c % 4 < 2 else np.zeros(n, np.float32)
                c += 1
                with pytest.raises(NonFiniteError) as err:
                    dev.encode_with_feedback(cuda.to_device(x),
                                             None if e is None else cuda.to_device(e),
                                             None if e_out is None else cuda.to_device(e_out),
                                             _ctx(rng))
                assert str(err.value) == str(host_err.value)
        # x finite, x + e overflows; the owner's w = acc + e overflows
        n = 33
        big = np.full(n, 3e38, np.float32)
        with pytest.raises(NonFiniteError):
            dev.encode_with_feedback(cuda.to_device(big), cuda.to_device(big),
                                     cuda.to_device(np.zeros(n, np.float32)), _ctx(rng))
        with pytest.raises(NonFiniteError):
            dev.owner_step([cuda.to_device(codec.encode(big))], cuda.to_device(big), None,
                           cuda.to_device(np.zeros(n, np.float32)), _ctx(rng))
        # propagate: the same bits
        prop = hpccomm.get_codec(name, nonfinite="propagate", **params)
        for n in (7, 203):
            for bad in (np.nan, np.inf, -np.inf):
                x = _data("gauss", n, n)
                x[1::5] = bad
                e = None if c % 2 else _data("gauss", n, 1)
                _check_feedback(prop, x, e, c % 3 != 1, _ctx(rng, True), f"{name} {bad} n={n}")
                c += 1
        # ctx.finite: no scan, as on the host
        x = _data("gauss", 33, 2)
        x[3] = np.nan
        ctx = replace(_ctx(rng), finite=True)
        host = codec.encode(x, ctx)
        got = dev.encode_with_feedback(cuda.to_device(x), None, None, ctx).copy_to_host()
        _same(got, host, f"{name} finite=True")


# ---------------------------------------------------------------------------
# tests (run the checks)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", ["check_topk_encode", "check_topk_sampled", "check_dgc_encode",
                                   "check_owner_step", "check_decode_and_malformed",
                                   "check_nonfinite"])
def test_device_topk_matches_host(check):
    _run(check)

