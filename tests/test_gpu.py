"""On a real GPU: the device twins against the host codecs at sizes the
simulator cannot reach, and the reducer's device path on CuPy and torch
buffers (one rank).  Marked ``gpu``; every test skips when numba.cuda finds
no GPU (or CuPy / torch's CUDA is missing for the buffer tests).

    python -m pytest -q -m gpu tests/test_gpu.py
"""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import EncodeContext


def _gpu_missing() -> str:
    try:
        from numba import config, cuda
    except ImportError as exc:
        return f"numba.cuda unavailable: {exc}"
    if config.ENABLE_CUDASIM:
        return "NUMBA_ENABLE_CUDASIM=1 (the simulator is tested elsewhere)"
    try:
        return "" if cuda.is_available() else "numba.cuda finds no GPU"
    except Exception as exc:  # noqa: BLE001 - any driver error means: no GPU here
        return f"numba.cuda: {exc}"


MISSING = _gpu_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(MISSING), reason=MISSING or "-")]

PARAMS = {"topk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}, "randk": {"ratio": 0.01},
          "qsgd": {"bits": 4, "bucket": 512}}
SIZES = [1, 4097, (1 << 20) + 3]


def _twins():
    if MISSING:
        return []
    from hpccomm.device_codecs import device_codec_names

    return device_codec_names()


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
    want = codec.encode(v, EncodeContext(seed=3, rank=1, step=5, offset=64, shape=(n,),
                                         feedback=True, fresh=x))
    e_out = U.empty(n, np.float32)
    packet = twin.encode_with_feedback(U.to_device(x), U.to_device(e), e_out, ctx)
    assert np.array_equal(U.to_host(packet), want)
    decoded = codec.decode(want, np.empty(n, np.float32))
    assert np.array_equal(U.to_host(e_out).view(np.uint32), (v - decoded).view(np.uint32))
    out = U.empty(n, np.float32)
    twin.decode(U.to_device(want), out)
    assert np.array_equal(U.to_host(out).view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("buffer", ["cupy", "torch"])
@pytest.mark.parametrize("codec_name", ["onebit", "bf16", "topk", "qsgd"])
def test_device_path_on_gpu_buffers(buffer, codec_name):
    """One rank: the device path on CuPy / torch CUDA buffers gives the host
    path's bits and stages only the packet."""
    from mpi4py import MPI

    if codec_name not in _twins():
        pytest.skip(f"{codec_name} has no device twin")
    x = np.random.default_rng(1).standard_normal(1 << 16).astype(np.float32)
    if buffer == "cupy":
        cupy = pytest.importorskip("cupy")
        dev_x, back = cupy.asarray(x), (lambda a: a.get())
    else:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        dev_x, back = torch.from_numpy(x).cuda(), (lambda a: a.cpu().numpy())
    opts = PARAMS.get(codec_name, {})
    host = hpccomm.Allreducer(MPI.COMM_SELF, codec=codec_name, algorithm="twoshot", **opts)
    dev = hpccomm.Allreducer(MPI.COMM_SELF, codec=codec_name, algorithm="twoshot", **opts)
    for _ in range(2):
        want = host(x.copy(), key="g")
        got = back(dev(dev_x, key="g"))
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
    assert dev.stats.last.extra["staged"] == "packets"
