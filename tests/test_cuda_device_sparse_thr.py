"""Device twins of ``threshold``, ``adaptive`` and ``randk``
(:mod:`hpccomm.device_codecs`) against the host codecs' three-step
reference, on numba's CUDA simulator.

As in ``tests/test_cuda_sim.py`` each check runs in a process of its own with
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) and is skipped when
the simulator is missing.  The simulator runs each thread's code in Python,
so the inputs stay small and the grids are sampled: every size meets
several parameter sets, contexts, feedback flags and residual forms, not all
of their products.  The demands are exact: the packet's bytes, the residual's
and the decoded vector's bits, the host decoder's PacketError (and message)
with ``out`` untouched.

The kernels' compilation for a real GPU (the CUDA target's typing, fused
products) is ``tests/test_cuda_compile.py``'s: the simulator runs plain IEEE
arithmetic and would not notice.
"""
import functools
import itertools
import warnings
from dataclasses import replace

import numpy as np
import pytest

from .cudasim import run_check

SIZES = [0, 1, 7, 33, 203, 1000]


_run = functools.partial(run_check, "test_cuda_device_sparse_thr", timeout=600)


# ---------------------------------------------------------------------------
# helpers (inside the simulator subprocess)
# ---------------------------------------------------------------------------
def _setup():
    from numba import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    # the simulator runs uint64 hashes and inf - inf on numpy scalars, which warn
    warnings.simplefilter("ignore", RuntimeWarning)
    from hpccomm.kernels import cuda_util as U

    return U


def _twin(name, **params):
    import hpccomm
    from hpccomm.device_codecs.base import device_codec_for

    codec = hpccomm.get_codec(name, **params)
    twin = device_codec_for(codec)
    assert twin is not None and twin.codec is codec, name
    return codec, twin


def _data(n, seed, ties=True):
    """Gaussian float32 with zeros (+0.0, -0.0) and, with ``ties``, a quarter
    of the elements at +-2.0 (ties at every magnitude cut that falls there)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if ties and n > 8:
        at = rng.choice(n, n // 4, replace=False)
        x[at] = np.where(rng.random(at.size) < 0.5, -2.0, 2.0).astype(np.float32)
    if n > 6:
        x[5], x[6] = 0.0, -0.0
    return x


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _same(got, want, what):
    """Bitwise equality of float32 (or byte) arrays, with the first mismatch."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.float32:
        got, want = _bits(got), _bits(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} mismatches, first at {bad[0]}: "
                           f"{got[bad[0]]!r} != {want[bad[0]]!r}")


def _host_encode(codec, x, e, ctx):
    """The three-step reference of encode_with_feedback: ``(packet, v - decode)``."""
    v = x.copy() if e is None else x + e
    packet = codec.encode(v, replace(ctx, fresh=x) if ctx.feedback else ctx)
    return packet, v - codec.decode(packet, np.empty(x.size, np.float32))


def _host_owner(codec, n, packets, e, ctx, with_resid):
    """The three-step reference of owner_step: ``(packet, out, e_out)``."""
    acc = np.zeros(n, np.float32)
    for p in packets:
        codec.decode_add(p, acc)
    w = acc.copy() if e is None else acc + e
    packet = codec.reencode(w, replace(ctx, fresh=acc) if ctx.feedback and with_resid else ctx)
    out = codec.decode(packet, np.empty(n, np.float32))
    return packet, out, w - out


def _misaligned(U, packet, shift=3):
    """A device copy of ``packet`` starting ``shift`` bytes into a buffer (as
    packets received into one buffer lie)."""
    buf = np.zeros(packet.size + 8, np.uint8)
    buf[shift:shift + packet.size] = packet
    return U.to_device(buf)[shift:shift + packet.size]


def _encode_case(U, codec, twin, n, ctx, feedback, with_e, with_resid, seed, ties=True):
    ctx = replace(ctx, feedback=feedback)
    x = _data(n, seed, ties)
    e = _data(n, seed + 1, False) * np.float32(0.5) if with_e else None
    packet, resid = _host_encode(codec, x, e, ctx)
    dx = U.to_device(x)
    de = None if e is None else U.to_device(e)
    d_out = U.to_device(np.full(n, 9.0, np.float32)) if with_resid else None
    got = U.to_host(twin.encode_with_feedback(dx, de, d_out, ctx))
    what = f"{codec.describe()} n={n} {ctx} e={with_e} e_out={with_resid}"
    _same(got, packet, f"packet of {what}")
    if with_resid:
        _same(U.to_host(d_out), resid, f"e_out of {what}")
    _same(U.to_host(dx), x, f"x kept, {what}")
    if e is not None:
        _same(U.to_host(de), e, f"e kept, {what}")
    return packet


def _contexts(shapes=((),)):
    """A cycle of contexts with different seed, rank, step, offset (and shape)."""
    from hpccomm.codecs.base import EncodeContext

    base = [EncodeContext(seed=0, rank=0, step=0, offset=0),
            EncodeContext(seed=7, rank=2, step=5, offset=1000),
            EncodeContext(seed=123, rank=1, step=1, offset=3),
            EncodeContext(seed=5, rank=4, step=9, offset=77)]
    return itertools.cycle([replace(c, shape=s) for c in base for s in shapes])


#: (feedback, e given, e_out given): all eight, cycled through the cases
FORMS = list(itertools.product((True, False), repeat=3))


def _encode_grid(name, param_sets, shapes=((),), per_size=None):
    """Every parameter set meets every size; each (set, size) case runs
    ``per_size(n)`` of the eight residual forms, cycling, with the next
    context."""
    U = _setup()
    ctxs = _contexts(shapes)
    forms = itertools.cycle(FORMS)
    packets = []
    for k, params in enumerate(param_sets):
        codec, twin = _twin(name, **params)
        for n in SIZES:
            for _ in range(per_size(n) if per_size else (1 if n >= 1000 else 3)):
                fb, with_e, with_resid = next(forms)
                packets.append((codec, n, _encode_case(U, codec, twin, n, next(ctxs), fb,
                                                       with_e, with_resid, seed=10 * k + n)))
    return packets


# ---------------------------------------------------------------------------
# checks: encode_with_feedback
# ---------------------------------------------------------------------------
THRESHOLD_SETS = [{}, {"tau": 0.5, "max_ratio": 0.05}, {"alpha": 0.5, "max_ratio": 0.1},
                  {"tau": 1.0}]


def check_threshold_encode():
    packets = _encode_grid("threshold", THRESHOLD_SETS)
    # the capacity cut ran, inside the ties at +-2.0 (a quarter of the elements)
    capped = [(c, n) for c, n, p in packets
              if n >= 33 and int(p[4:8].view(np.uint32)[0]) == c.max_count(n)]
    assert len(capped) >= 4, capped
    # a cut on a radix bin's edge: exactly cap = 10 candidates in the top bin
    # (3.0 .. 3.9 share their top 8 bits), 30 more below it
    U = _setup()
    from hpccomm.codecs.base import EncodeContext

    codec, twin = _twin("threshold", tau=0.5, max_ratio=0.1)
    rng = np.random.default_rng(0)
    for top in (np.full(10, 3.0), np.linspace(3.0, 3.9, 10)):
        x = (rng.random(100) * 0.8 - 0.4).astype(np.float32)
        at = rng.permutation(100)[:40]
        x[at] = np.concatenate([top, np.full(30, 1.0)]) * rng.choice([-1, 1], 40)
        for fb, with_e, with_resid in FORMS[::3]:
            _encode_case_values(U, codec, twin, x, np.zeros(100, np.float32) if with_e else None,
                                EncodeContext(feedback=fb), with_resid)


def check_sum_squares():
    """Threshold's float64 sum of squares, bit for bit with the CPU's (lanes,
    tail, blocks of 65536 in order), on magnitudes wide enough that another
    order changes the bits."""
    U = _setup()
    from hpccomm.kernels import cuda_select as S
    from hpccomm.kernels.sparsify import sum_squares

    codec, twin = _twin("threshold")
    rng = np.random.default_rng(1)
    for n in (1, 7, 9, 100, 65536 + 3, 2 * 65536 + 17):
        g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(np.float32)
        tau = U.empty(1, np.float32)
        S.threshold_tau(U.to_device(g), 2.5, tau, twin.scratch)
        got = U.to_host(twin.scratch("ss", 1, np.float64))[0]
        want = sum_squares(g)
        assert got.view(np.uint64) == np.float64(want).view(np.uint64), (n, got, want)
        assert U.to_host(tau)[0] == np.float32(2.5 * np.sqrt(want / n)), n


ADAPTIVE_SETS = [{"proportion": 2, "col_len": 50, "samples": 16},
                 {"proportion": 16, "col_len": 64, "samples": 128, "excess": 1},
                 {"proportion": 4, "samples": 32, "excess": 1},
                 {}]


def _capped_columns(codec, packet):
    """How many (column, sign) sides of an adaptive packet sit at their cap."""
    from hpccomm.codecs.adaptive import COLUMN, PREFIX
    from hpccomm.kernels.sparsify import adaptive_cap

    n = int(packet[8:16].view(np.uint64)[0])
    if n == 0:
        return 0
    H = int(packet[16:20].view(np.uint32)[0])
    W = -(-n // H)
    cols = packet[PREFIX:PREFIX + 12 * W].view(COLUMN)
    words = packet[PREFIX + 12 * W:].view(np.uint32)
    hits, k = 0, 0
    for c in range(W):
        h = min(H, n - c * H)
        cap = adaptive_cap(h, codec.proportion, codec.excess)
        w = words[k:k + int(cols["count"][c])]
        k += w.size
        hits += int(np.count_nonzero(w & 1) == cap) + int(np.count_nonzero(~w & 1) == cap)
    return hits


def check_adaptive_encode():
    packets = _encode_grid("adaptive", ADAPTIVE_SETS, shapes=((), (4, 37), (3, 11)))
    assert sum(_capped_columns(c, p) for c, n, p in packets) >= 10


RANDK_SETS = [{"ratio": 0.1}, {"ratio": 0.1, "unbiased": False}, {"ratio": 1.0},
              {"ratio": 0.01}]


def check_randk_encode():
    _encode_grid("randk", RANDK_SETS)


def check_randk_indices():
    """The device's Floyd draws give the host's sorted k-subsets (cached per
    key, n, k; a full set when k = n)."""
    U = _setup()
    from hpccomm.codecs.randk import index_key, random_indices

    codec, twin = _twin("randk")
    for n, k in ((1, 1), (7, 3), (64, 64), (65, 2), (203, 20), (1000, 10), (1000, 999)):
        for step in (0, 3):
            key = index_key(11, step, n)
            idx = twin.indices(key, n, k)
            _same(U.to_host(idx), random_indices(key, n, k), f"indices n={n} k={k}")
            assert twin.indices(key, n, k) is idx
    # a set made on one stream, used on another
    from numba import cuda

    key = index_key(3, 4, 5)
    with U.on_stream(cuda.stream()):
        idx = twin.indices(key, 500, 50)
    assert twin.indices(key, 500, 50) is idx
    _same(U.to_host(idx), random_indices(key, 500, 50), "indices across streams")


# ---------------------------------------------------------------------------
# checks: owner step and decode
# ---------------------------------------------------------------------------
def _owner_grid(name, param_sets, shapes=((),), sizes=(0, 1, 7, 33, 203)):
    U = _setup()
    from hpccomm.codecs.base import EncodeContext

    forms = itertools.cycle(FORMS)
    shape_cycle = itertools.cycle(shapes)
    for k, params in enumerate(param_sets):
        codec, twin = _twin(name, **params)
        for n, P in itertools.product(sizes, (1, 2, 3)):
            fb, with_e, with_resid = next(forms)
            ctx = EncodeContext(seed=k + 3, rank=P + 1, step=n % 5, offset=n,
                                shape=next(shape_cycle), feedback=fb)
            xs = [_data(n, 100 * r + n) for r in range(P)]
            packets = [codec.encode(x, replace(ctx, rank=r, feedback=False))
                       for r, x in enumerate(xs)]
            e = _data(n, n + 5, False) * np.float32(0.25) if with_e else None
            packet, out, resid = _host_owner(codec, n, packets, e, ctx, with_resid)
            received = [U.to_device(p) if r % 2 == 0 else _misaligned(U, p)
                        for r, p in enumerate(packets)]
            d_e = None if e is None else U.to_device(e)
            d_resid = U.to_device(np.full(n, 5.0, np.float32)) if with_resid else None
            d_out = U.to_device(np.full(n, 7.0, np.float32))
            got = U.to_host(twin.owner_step(received, d_e, d_resid, d_out, ctx))
            what = f"owner {codec.describe()} n={n} P={P} fb={fb} e={with_e} e_out={with_resid}"
            _same(got, packet, f"packet of {what}")
            _same(U.to_host(d_out), out, f"out of {what}")
            if with_resid:
                _same(U.to_host(d_resid), resid, f"e_out of {what}")


def check_owner_step():
    _owner_grid("threshold", [{"alpha": 1.0, "max_ratio": 0.1}, {"tau": 0.7}])
    _owner_grid("adaptive", [{"proportion": 2, "col_len": 9, "samples": 16},
                             {"proportion": 4, "samples": 32, "excess": 1}],
                shapes=((), (2, 13)))
    _owner_grid("randk", [{"ratio": 0.2}, {"ratio": 0.05, "unbiased": False}])


def check_decode():
    """decode / decode-add of host packets (aligned and not) bit for bit."""
    U = _setup()
    from hpccomm.codecs.base import EncodeContext

    cases = [("threshold", {}), ("threshold", {"tau": 0.5, "max_ratio": 0.05}),
             ("adaptive", {"proportion": 2, "col_len": 9, "samples": 16}), ("adaptive", {}),
             ("randk", {"ratio": 0.1}), ("randk", {"ratio": 0.3, "unbiased": False})]
    for (name, params), n in itertools.product(cases, (0, 1, 33, 203)):
        codec, twin = _twin(name, **params)
        ctx = EncodeContext(seed=n, rank=1, step=2, offset=n + 1, shape=(n,))
        packet = codec.encode(_data(n, n + 1), ctx)
        base = _data(n, n + 2, False)
        for misaligned, add in itertools.product((False, True), repeat=2):
            d = _misaligned(U, packet) if misaligned else U.to_device(packet)
            out = U.to_device(base)
            twin.decode(d, out, add=add)
            want = base.copy()
            (codec.decode_add if add else codec.decode)(packet, want)
            _same(U.to_host(out), want, f"decode{'-add' if add else ''} {name} {params} n={n}")


# ---------------------------------------------------------------------------
# checks: malformed packets, NaN/Inf
# ---------------------------------------------------------------------------
def _malformed_threshold():
    from hpccomm.codecs.base import EncodeContext

    codec = __import__("hpccomm").get_codec("threshold", tau=0.5)
    n = 203
    good = codec.encode(_data(n, 4), EncodeContext())
    words = good[24:].view(np.uint32)
    assert words.size >= 3

    def edit(f):
        p = good.copy()
        f(p, p[24:].view(np.uint32))
        return p
    yield codec, n, "swapped words", edit(lambda p, w: w.__setitem__(slice(0, 2), w[1::-1]))
    yield codec, n, "repeated word", edit(lambda p, w: w.__setitem__(1, w[0]))
    yield codec, n, "index n", edit(lambda p, w: w.__setitem__(-1, np.uint32(n << 1)))
    yield codec, n, "index past n", edit(lambda p, w: w.__setitem__(-1, np.uint32(1 << 31)))
    yield codec, n, "NaN tau", edit(lambda p, w: p[16:20].view(np.float32).__setitem__(0, np.nan))
    yield codec, n, "inf tau", edit(lambda p, w: p[16:20].view(np.float32).__setitem__(0, np.inf))
    yield codec, n, "negative tau", edit(lambda p, w: p[16:20].view(np.float32).__setitem__(0, -1))
    yield codec, n, "padding", edit(lambda p, w: p.__setitem__(21, 1))


def _malformed_adaptive():
    from hpccomm.codecs.adaptive import PREFIX
    from hpccomm.codecs.base import EncodeContext

    codec = __import__("hpccomm").get_codec("adaptive", proportion=2, col_len=10, samples=16,
                                            excess=1)
    n = 47
    good = codec.encode(_data(n, 6), EncodeContext())
    W = -(-n // 10)

    def edit(f):
        p = good.copy()
        f(p[PREFIX:PREFIX + 12 * W].view(np.uint32), p[PREFIX + 12 * W:].view(np.uint32))
        return p

    def shift_count(r, w):      # counts still add up to m, but split wrongly
        r[0] += 1
        r[3] -= 1
    counts = good[PREFIX:PREFIX + 12 * W].view(np.uint32)[0::3]
    assert counts[0] >= 2 and counts[1] >= 1, counts
    yield codec, n, "count moved", edit(shift_count)
    yield codec, n, "count too large", edit(lambda r, w: r.__setitem__(3 * (W - 1),
                                                                       r[3 * (W - 1)] + 1))
    yield codec, n, "rows swapped", edit(lambda r, w: w.__setitem__(slice(0, 2), w[1::-1]))
    yield codec, n, "row past h", edit(lambda r, w: w.__setitem__(0, np.uint32(10 << 1)))
    yield codec, n, "last column row past h", edit(lambda r, w: w.__setitem__(-1, np.uint32(
        (n - 10 * (W - 1)) << 1)))

    # more than cap(h) = 2 entries of one sign: a column's entries all made
    # positive (rows 0, 1, ...), in columns of 16 that send up to 2 per sign
    codec = __import__("hpccomm").get_codec("adaptive", proportion=8, col_len=16, excess=1)
    n = 64
    over = codec.encode(_data(n, 8), EncodeContext())
    counts = over[PREFIX:PREFIX + 48].view(np.uint32)[0::3].astype(int)
    c = int(np.argmax(counts))
    assert counts[c] > 2, counts
    at = PREFIX + 48 + 4 * int(counts[:c].sum())
    over[at:at + 4 * counts[c]].view(np.uint32)[:] = (np.arange(counts[c], dtype=np.uint32)
                                                      << 1) | 1
    yield codec, n, "sign over cap", over


def check_malformed():
    """A payload the host decoder rejects (headers valid) raises the same
    PacketError on the device -- decode, decode-add and owner_step -- before
    ``out`` (or ``e_out``) is touched."""
    U = _setup()
    from hpccomm.codecs.base import EncodeContext
    from hpccomm.device_codecs.base import device_codec_for
    from hpccomm.errors import PacketError

    cases = list(_malformed_threshold()) + list(_malformed_adaptive())
    assert len(cases) == 14
    for codec, n, what, bad in cases:
        codec.check_header(bad, n)                       # the header passes ...
        with pytest.raises(PacketError) as host:         # ... the payload does not
            codec.decode(bad, np.empty(n, np.float32))
        twin = device_codec_for(codec)
        sentinel = np.arange(n, dtype=np.float32)
        for add in (False, True):
            out = U.to_device(sentinel)
            with pytest.raises(PacketError) as dev:
                twin.decode(_misaligned(U, bad) if add else U.to_device(bad), out, add=add)
            assert str(dev.value) == str(host.value), (what, str(dev.value), str(host.value))
            _same(U.to_host(out), sentinel, f"out untouched by {codec.name} {what}")
        good = codec.encode(_data(n, 1), EncodeContext())
        out = U.to_device(sentinel)
        resid = U.to_device(sentinel + 1)
        with pytest.raises(PacketError):
            twin.owner_step([U.to_device(good), U.to_device(bad)], None, resid, out,
                            EncodeContext(feedback=True))
        _same(U.to_host(out), sentinel, f"out untouched by owner_step, {what}")
        _same(U.to_host(resid), sentinel + 1, f"e_out untouched by owner_step, {what}")
    # randk: the host decoder validates nothing past the header -- a packet
    # under another index key decodes, there as here
    codec, twin = _twin("randk", ratio=0.1)
    packet = codec.encode(_data(203, 2), EncodeContext(step=1))
    packet[16:24].view(np.uint64)[0] ^= np.uint64(0x5A5A)
    out = U.to_device(np.zeros(203, np.float32))
    twin.decode(U.to_device(packet), out)
    _same(U.to_host(out), codec.decode(packet, np.empty(203, np.float32)), "randk other key")


def check_nonfinite():
    """NaN/Inf in ``v`` raise NonFiniteError (``nonfinite="raise"``; not under
    ``ctx.finite`` without ``e``); ``"propagate"`` sends what the host sends."""
    U = _setup()
    from hpccomm.codecs.base import EncodeContext
    from hpccomm.errors import NonFiniteError

    n = 203
    cases = [("threshold", {}), ("threshold", {"tau": 0.5, "max_ratio": 0.05}),
             ("adaptive", {"proportion": 2, "col_len": 20, "samples": 16}),
             ("randk", {"ratio": 0.1})]
    ctx = EncodeContext(seed=1, step=2, feedback=True)
    for (name, params), bad in itertools.product(cases, (np.nan, np.inf, -np.inf)):
        codec, twin = _twin(name, **params)
        x = _data(n, 3)
        x[[17, 150]] = bad
        e = _data(n, 4, False)
        for with_e, with_resid in itertools.product((False, True), repeat=2):
            with pytest.raises(NonFiniteError):
                twin.encode_with_feedback(U.to_device(x), U.to_device(e) if with_e else None,
                                          U.empty(n, np.float32) if with_resid else None, ctx)
        # the owner: NaN/Inf in its residual
        packets = [codec.encode(_data(n, 5), replace(ctx, feedback=False))]
        with pytest.raises(NonFiniteError):
            twin.owner_step([U.to_device(p) for p in packets], U.to_device(x), None,
                            U.empty(n, np.float32), ctx)
        # ctx.finite: the caller scanned x; without e nothing is checked again
        # (the host's adaptive.encode scans anyway: its packet from "propagate")
        pcodec, ptwin = _twin(name, nonfinite="propagate", **params)
        fin = replace(ctx, finite=True)
        got = twin.encode_with_feedback(U.to_device(x), None, None, fin)
        _same(U.to_host(got), pcodec.encode(x, replace(fin, fresh=x)), f"{name} finite=True")
        # "propagate": the host's packet, residual and owner results
        _encode_case_values(U, pcodec, ptwin, x, e, ctx)
        packet, out, resid = _host_owner(pcodec, n, packets, x, ctx, True)
        d_out, d_resid = U.empty(n, np.float32), U.empty(n, np.float32)
        got = ptwin.owner_step([U.to_device(p) for p in packets], U.to_device(x), d_resid,
                               d_out, ctx)
        _same(U.to_host(got), packet, f"propagate owner packet {name}")
        _same(U.to_host(d_out), out, f"propagate owner out {name}")
        _same(U.to_host(d_resid), resid, f"propagate owner e_out {name}")


def _encode_case_values(U, codec, twin, x, e, ctx, with_resid=True):
    """encode_with_feedback of given ``x`` and ``e`` against the host."""
    packet, resid = _host_encode(codec, x, e, ctx)
    d_resid = U.empty(x.size, np.float32) if with_resid else None
    got = twin.encode_with_feedback(U.to_device(x), None if e is None else U.to_device(e),
                                    d_resid, ctx)
    what = f"{codec.describe()} {ctx} e={e is not None}"
    _same(U.to_host(got), packet, f"packet of {what}")
    if with_resid:
        _same(U.to_host(d_resid), resid, f"e_out of {what}")


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", ["check_threshold_encode", "check_sum_squares",
                                   "check_adaptive_encode",
                                   "check_randk_encode", "check_randk_indices",
                                   "check_owner_step", "check_decode", "check_malformed",
                                   "check_nonfinite"])
def test_device_twin(check):
    _run(check)

