"""On a real GPU: the device twins against the host codecs at sizes the
simulator cannot reach, and the reducer's device path on the buffers users
pass (CuPy, torch CUDA), one rank (``tests/test_gpu_mpi.py`` runs the
collectives under mpiexec).  Marked ``gpu``; run by ``./dev.sh gpu``::

    python -m pytest -q -m gpu tests/test_gpu.py

Under ``NUMBA_ENABLE_CUDASIM=1`` (``./dev.sh gpu --simulate``) the same
tests run on the simulator at tiny sizes, on host memory presented as device
memory; the tests that need CuPy, torch CUDA or gigabytes skip there.
Without either they skip (``tests/gpu.py``).

Every comparison is bit for bit against the host codec or the host path of
the same reducer configuration.
"""
from dataclasses import replace

import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import EncodeContext

from . import gpu
from .gpu import KINDS, MISSING, MODE, SIM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not MODE, reason=MISSING or "-")]

PARAMS = {"topk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}, "randk": {"ratio": 0.01},
          "qsgd": {"bits": 4, "bucket": 512}, "threshold": {"max_ratio": 0.25}}
SIZES = [1, 203] if SIM else [1, 4097, (1 << 20) + 3]
#: the reducer tests' length (2-D when it splits into 29 columns)
N = 29 * 7 if SIM else 29 * (1 << 14)
CODECS = ["onebit", "bf16", "topk", "qsgd"]


def _twins():
    if not MODE:
        return []
    from hpccomm.device_codecs import device_codec_names

    return device_codec_names()


def _same(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@pytest.fixture
def sim_backend():
    backend = gpu.register_sim_backend()
    yield backend
    gpu.unregister(backend)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec_name", _twins())
def test_twin_same_bytes_as_host(codec_name, n):
    """Packet bytes, residual and decoded values of the device twin equal the
    host codec's, bit for bit (FMA contraction, reduction order and rounding
    would show here)."""
    from hpccomm.device_codecs import device_codec_for
    from hpccomm.kernels import cuda_util as U

    codec = hpccomm.get_codec(codec_name, **PARAMS.get(codec_name, {}))
    twin = device_codec_for(codec)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    e = (rng.standard_normal(n) * 0.1).astype(np.float32)
    ctx = EncodeContext(seed=3, rank=1, step=5, offset=64, shape=(n,), feedback=True)
    v = x + e
    want = codec.encode(v, replace(ctx, fresh=x))
    e_out = U.empty(n, np.float32)
    packet = twin.encode_with_feedback(U.to_device(x), U.to_device(e), e_out, ctx)
    assert _same(U.to_host(packet), want)
    decoded = codec.decode(want, np.empty(n, np.float32))
    assert _same(U.to_host(e_out), v - decoded)
    out = U.empty(n, np.float32)
    twin.decode(U.to_device(want), out)
    assert _same(U.to_host(out), decoded)


@pytest.mark.parametrize("packets", [1, 2, 5])
@pytest.mark.parametrize("codec_name", _twins())
def test_owner_step_same_bytes_as_host(codec_name, packets):
    """twoshot's owner step on 1, 2 and 5 received packets (5: the dense
    twins sum a group of four first): the host's packet, residual and
    result, bit for bit."""
    from hpccomm.device_codecs import device_codec_for
    from hpccomm.kernels import cuda_util as U

    codec = hpccomm.get_codec(codec_name, **PARAMS.get(codec_name, {}))
    twin = device_codec_for(codec)
    m = SIZES[-1]
    rng = np.random.default_rng([m, packets])
    received = [codec.encode(rng.standard_normal(m).astype(np.float32),
                             EncodeContext(seed=3, rank=r, step=2, offset=96, shape=(m,)))
                for r in range(packets)]
    e = (rng.standard_normal(m) * 0.1).astype(np.float32)
    ctx = EncodeContext(seed=3, rank=packets, step=2, offset=96, shape=(m,), feedback=True)
    acc = np.zeros(m, np.float32)          # the host's steps: decode-add in rank order,
    for p in received:                     # + e, reencode, residual, decode
        codec.decode_add(p, acc)
    w = acc + e
    want = codec.reencode(w, replace(ctx, fresh=acc))
    decoded = codec.decode(want, np.empty(m, np.float32))
    e_out, out = U.empty(m, np.float32), U.empty(m, np.float32)
    got = twin.owner_step([U.to_device(p) for p in received], U.to_device(e), e_out, out, ctx)
    assert _same(U.to_host(got), want)
    assert _same(U.to_host(e_out), w - decoded) and _same(U.to_host(out), decoded)


def _pair(codec_name, **kw):
    opts = dict(PARAMS.get(codec_name, {}), **kw)
    from mpi4py import MPI

    return (hpccomm.Allreducer(MPI.COMM_SELF, codec=codec_name, algorithm="twoshot", **opts),
            hpccomm.Allreducer(MPI.COMM_SELF, codec=codec_name, algorithm="twoshot", **opts))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec_name", CODECS)
def test_device_path_on_gpu_buffers(sim_backend, kind, codec_name):
    """One rank: the device path on the buffers users pass gives the host
    path's bits, keeps residuals across calls, and stages only the packet."""
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32).reshape(-1, 29)
    host, dev = _pair(codec_name, error_feedback=True)
    for _ in range(2):
        want = host(x.copy(), key="g")
        got = gpu.host(dev(gpu.device_array(x, kind), key="g"))
        assert _same(got, want)
    assert dev.stats.last.extra["staged"] == "packets"


def _on_side_stream(kind, values):
    """``run(fn)``: on a stream other than the default one, slow work, then
    ``values`` written into a device buffer ``x`` (a reader on any other
    stream would find it unwritten), then ``fn(x)`` with that stream current,
    then a copy of its result made by later work on the same stream (after
    hpccomm's kernels only if they ran there); returns that copy on the host.
    Nothing is synchronized in between."""
    if kind == "cupy":
        import cupy

        src = cupy.asarray(values)
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.Device().synchronize()

        def run(fn):
            with stream:
                busy = cupy.ones((4096, 4096), np.float32)
                x = cupy.full(values.shape, np.nan, np.float32)
                for _ in range(8):
                    busy = busy @ busy * np.float32(1e-4)
                x[...] = src
                copy = fn(x) * np.float32(1)
            stream.synchronize()
            return copy.get()

        return run
    import torch

    src = torch.from_numpy(values).cuda()
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()

    def run(fn):
        with torch.cuda.stream(stream):
            busy = torch.ones((4096, 4096), device="cuda")
            x = torch.full(values.shape, float("nan"), device="cuda")
            for _ in range(8):
                busy = busy @ busy * 1e-4
            x.copy_(src)
            copy = fn(x) * 1
        stream.synchronize()
        return copy.cpu().numpy()

    return run


@pytest.mark.parametrize("kind", [k for k in KINDS if k in ("cupy", "torch")])
@pytest.mark.parametrize("codec_name", CODECS)
def test_input_on_a_side_stream(kind, codec_name):
    """Input written on a non-default stream, not synchronized: the call reads
    it after the write and its result is ordered before the caller's next
    work on that stream -- the host reference's bits (blocking and started)."""
    values = np.random.default_rng(7).standard_normal(N).astype(np.float32).reshape(-1, 29)
    host, dev = _pair(codec_name, error_feedback=True)
    want = [host(values.copy(), key="s") for _ in range(2)]
    run = _on_side_stream(kind, values)
    assert _same(run(lambda a: dev(a, key="s")), want[0])
    assert _same(run(lambda a: dev.start(a, key="s").wait()), want[1])


@pytest.mark.parametrize("kind", KINDS)
def test_start_wait_with_buckets(sim_backend, kind):
    """Buckets started one after another and waited for at the end (the
    progress thread runs them): each the host path's blocking result."""
    rng = np.random.default_rng(11)
    buckets = [rng.standard_normal(n).astype(np.float32) for n in (N, N // 3 + 1, 4 * N)]
    host, dev = _pair("onebit", error_feedback=True)
    for step in range(2):
        want = [host(b.copy(), key=f"b{i}") for i, b in enumerate(buckets)]
        inputs = [gpu.device_array(b, kind) for b in buckets]
        requests = [dev.start(x, key=f"b{i}") for i, x in enumerate(inputs)]
        got = [gpu.host(r.wait()) for r in requests]
        assert all(_same(g, w) for g, w in zip(got, want)), step


def test_grad_reducer_overlap_on_cuda():
    """PyTorch on the GPU: GradReducer with overlap (buckets started from the
    backward hooks) gives the bits of the same gradients reduced on the host.

    With overlap a bucket is reduced in place as soon as its gradients are
    final, so ``.grad`` is in flux from then until ``reducer()`` returns: the
    gradients are copied, on the GPU, by post-accumulate-grad hooks registered
    before the reducer's own, which run first for each parameter -- before
    its bucket can start."""
    torch = pytest.importorskip("torch")
    if "torch" not in KINDS:
        pytest.skip("torch has no CUDA")
    from hpccomm.torch_grads import GradReducer

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 10))

    model, twin = make().cuda(), make()
    local = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: local.__setitem__(name, p.grad.detach().clone()))
    opts = dict(codec="onebit", algorithm="twoshot", min_compress=1024, bucket_bytes=1 << 20)
    on_gpu = GradReducer(model, overlap=True, **opts)
    on_host = GradReducer(twin, **opts)
    x = torch.randn(64, 512, device="cuda")
    for step in range(2):
        model.zero_grad(set_to_none=False)
        local.clear()
        model(x).square().mean().backward()
        assert on_gpu.started == len(on_gpu.buckets), step    # all started during backward
        on_gpu()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            q.grad = local[name].cpu()
        on_host()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert _same(p.grad.cpu().numpy(), q.grad.numpy()), step


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec_name", ["onebit", "topk"])
def test_state_dict_round_trip(sim_backend, kind, codec_name):
    """Residuals on the GPU: ``state_dict`` holds host copies, and a reducer
    that loads them continues with the bits of the one that never stopped."""
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    _, a = _pair(codec_name, error_feedback=True)
    _, b = _pair(codec_name, error_feedback=True)
    for x in data[:2]:
        a(gpu.device_array(x, kind), key="r")
    saved = a.state_dict()
    assert all(type(v) is np.ndarray for v in saved["keys"]["r"]["residuals"].values())
    b.load_state_dict(saved)
    want = gpu.host(a(gpu.device_array(data[2], kind), key="r"))
    assert _same(gpu.host(b(gpu.device_array(data[2], kind), key="r")), want)


@pytest.mark.skipif(SIM, reason="needs 20 GiB of device memory")
@pytest.mark.parametrize("codec_name", ["fp16", "onebit"])
def test_index_arithmetic_beyond_2_31(codec_name):
    """``2**31 + 5`` elements: the packet's first and last columns and the
    decoded values there are the host codec's (an int32 index anywhere in a
    kernel would wrap and miss them)."""
    cupy = pytest.importorskip("cupy")
    from numba import cuda

    from hpccomm.device_codecs import device_codec_for
    from hpccomm.kernels import cuda_util as U

    n, tail = (1 << 31) + 5, 1 << 18         # the ends: 2 x 32 onebit columns of 4096
    codec = hpccomm.get_codec(codec_name)
    twin = device_codec_for(codec)
    gen = cupy.random.default_rng(3)
    x_c = gen.standard_normal(n, dtype=np.float32)
    x = cuda.as_cuda_array(x_c)
    ctx = EncodeContext(seed=1, rank=0, step=0, offset=0, shape=(n,))
    packet = twin.encode_with_feedback(x, None, None, ctx)
    out = U.empty(n, np.float32)
    twin.decode(packet, out)
    # a whole number of columns and sign words at each end
    col = codec.align((n,)) if codec_name == "onebit" else 1
    head_n = tail - tail % (32 * col)
    lo = (n - tail) - (n - tail) % (32 * col)
    for start, stop in ((0, head_n), (lo, n)):
        part = x_c[start:stop].get()
        want = codec.encode(part, replace(ctx, offset=start))
        decoded = codec.decode(want, np.empty(part.size, np.float32))
        assert _same(U.to_host(out[start:stop]), decoded), (codec_name, start)
        if codec_name == "fp16":
            got = U.to_host(packet[16 + 2 * start:16 + 2 * stop])
            assert _same(got, want[16:]), (codec_name, start)
        else:
            C = -(-n // col)
            got_means = U.to_host(packet[16 + 8 * (start // col):16 + 8 * (-(-stop // col))])
            c = -(-part.size // col)
            assert _same(got_means, want[16:16 + 8 * c]), (codec_name, start)
            words = 16 + 8 * C
            got_words = U.to_host(packet[words + 4 * (start // 32):words + 4 * (-(-stop // 32))])
            assert _same(got_words, want[16 + 8 * c:]), (codec_name, start)
