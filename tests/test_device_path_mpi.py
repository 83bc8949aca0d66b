"""The device path (:mod:`hpccomm.collectives.on_device`) through every codec
with a device twin and both device algorithms, under numba's CUDA simulator.

Run by ``tests/run.py`` as its ``cudasim-nK`` runs (K = 1, 3) (``mpiexec -n K`` with
``NUMBA_ENABLE_CUDASIM=1``, marker ``cudasim``); elsewhere these tests skip.
The "device" is host memory dressed as a CUDA array (:class:`SimDevice`),
which the simulator's kernels read and write in place, so the whole path runs:
twin kernels, packet staging (or device buffers handed to MPI with
``gpu_aware="on"``), owner step, decode.  Every result is compared bit for
bit with the host path of the same reducer configuration on the same data,
on every rank, and the bytes that crossed to the host are counted: the
gradient never does (the backend's own copies are never called), only
packets.
"""
import os
import warnings

import numpy as np
import pytest

import hpccomm
from hpccomm.errors import NonFiniteError

from .helpers import COMM, RANK, SIZE, FakeDeviceArray, FakeDeviceBackend, digest, \
    raise_everywhere, rank_data

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
pytestmark = [pytest.mark.mpi, pytest.mark.cudasim,
              pytest.mark.skipif(not SIM, reason="needs NUMBA_ENABLE_CUDASIM=1 (tests/run.py "
                                 "runs it so)")]

if SIM:
    warnings.simplefilter("ignore", RuntimeWarning)   # the simulator's uint64 hash wraps
    from hpccomm.device_codecs import device_codec_names

    TWINS = device_codec_names()
else:
    TWINS = ["none"]

#: codec parameters the tests use (small inputs: the simulator is slow)
PARAMS = {"topk": {"ratio": 0.1}, "dgc": {"ratio": 0.1}, "randk": {"ratio": 0.1},
          "threshold": {"max_ratio": 0.25}, "adaptive": {}, "qsgd": {"bits": 4, "bucket": 64}}


class SimDevice(FakeDeviceBackend):
    """:class:`FakeDeviceBackend` whose arrays the simulator's kernels may
    use: every copy of the gradient it is asked for is counted."""

    name = "sim"
    device_kernels = True


@pytest.fixture
def backend():
    b = SimDevice()
    hpccomm.register_device_backend(b)
    yield b
    hpccomm.unregister_device_backend(b)


def _pair(codec, algorithm, gpu_aware="off", **kw):
    opts = dict(PARAMS.get(codec, {}), **kw)
    host = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, **opts)
    dev = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, gpu_aware=gpu_aware, **opts)
    return host, dev


def _packet_bytes(codec, algorithm, n, shape):
    """Bytes of this rank's packets to and from the host per call, from the
    codec's size formula (fixed-size codecs), or None."""
    c = hpccomm.get_codec(codec, **PARAMS.get(codec, {}))
    from hpccomm.collectives.base import chunk_bounds

    if algorithm == "allgather" or SIZE == 1:
        size = c.wire_size_for(n, shape)
        if size is None:
            return None
        return (size, SIZE * size) if SIZE > 1 else (0, 0)
    b = chunk_bounds(n, SIZE, c.align(shape))
    sizes = [c.wire_size_for(int(b[j + 1] - b[j]), shape) for j in range(SIZE)]
    if None in sizes:
        return None
    # out: my P chunk packets + my owner packet; in: P packets of my chunk + all owner packets
    return sum(sizes) + sizes[RANK], SIZE * sizes[RANK] + sum(sizes)


@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
@pytest.mark.parametrize("codec", TWINS)
def test_device_path_matches_host(backend, codec, algorithm):
    """Two steps of one key with error feedback on (the second encodes with
    the residual the first left on the device), an awkward size: device result == host result, bit
    for bit, the same on every rank; only packets were staged."""
    host, dev = _pair(codec, algorithm, error_feedback=True)
    for step, shape in enumerate([(203,), (203,)]):
        n = int(np.prod(shape))
        x = rank_data(n, seed=step).reshape(shape)
        want = host(x.copy(), key="g")
        got = dev(FakeDeviceArray(x.copy()), key="g")
        extra = dict(dev.stats.last.extra)
        ok = np.array_equal(want.view(np.uint32), got.host.view(np.uint32))
        everyone = COMM.allgather((ok, digest(got.host)))
        assert all(e[0] for e in everyone), (codec, algorithm, step)
        assert len({e[1] for e in everyone}) == 1
        assert extra.get("staged") == "packets", extra
        expect = _packet_bytes(codec, algorithm, n, shape)
        if expect is not None:
            assert (extra["staged_d2h"], extra["staged_h2d"]) == expect, (extra, expect)
        else:   # data-dependent sizes: at most the packets' bound, far below the gradient
            c = hpccomm.get_codec(codec, **PARAMS.get(codec, {}))
            bound = (SIZE + 1) * c.max_wire_size(n) if SIZE > 1 else 0
            assert extra["staged_d2h"] <= bound and extra["staged_h2d"] <= bound, extra
    assert backend.to_host_calls == 0 and backend.from_host_calls == 0


@pytest.mark.parametrize("codec", ["none", "onebit", "bf16", "topk"])
def test_gpu_aware_device_buffers_to_mpi(backend, codec):
    """``gpu_aware="on"``: packets go to MPI from device memory; only the
    packets' leading bytes (the header check) come to the host."""
    if codec not in TWINS:
        pytest.skip(f"{codec} has no device twin")
    host, dev = _pair(codec, "twoshot", gpu_aware="on", error_feedback=True)
    for step in range(2):
        x = rank_data(150, seed=10 + step)
        want = host(x.copy(), key="g")
        got = dev(FakeDeviceArray(x.copy()), key="g")
        extra = dict(dev.stats.last.extra)
        ok = COMM.allgather(bool(np.array_equal(want.view(np.uint32), got.host.view(np.uint32))))
        assert all(ok)
        if SIZE > 1:
            assert extra["staged_h2d"] == 0
            assert extra["staged_d2h"] <= 2 * SIZE * 64, extra
    assert backend.to_host_calls == 0


def test_mean_out_and_shape(backend):
    """``op="mean"`` divides on the device; ``out=`` is written in place; a
    2-D shape gives per-column codecs their column length."""
    codec = "onebit" if "onebit" in TWINS else "none"
    host, dev = _pair(codec, "twoshot", op="mean")
    x = rank_data(7 * 29, seed=3).reshape(7, 29)
    want = host(x.copy(), key="m")
    out = FakeDeviceArray(np.full((7, 29), np.nan, np.float32))
    got = dev(FakeDeviceArray(x.copy()), key="m", out=out)
    assert got is out
    assert all(COMM.allgather(bool(np.array_equal(want, out.host))))


def test_nonfinite_raised_everywhere(backend):
    """A NaN on one rank's device buffer: the same error on every rank
    (the reducer's scan on the device, then the agreement)."""
    codec = "onebit" if "onebit" in TWINS else "none"
    _, dev = _pair(codec, "twoshot", nonfinite="raise")
    x = rank_data(64)
    if RANK == SIZE - 1:
        x[5] = np.nan
    got, same = raise_everywhere(lambda: dev(FakeDeviceArray(x), key="nan"))
    assert same and got[0] == NonFiniteError.__name__, got
    assert backend.to_host_calls == 0


def test_fallback_stages_gradient_and_says_why(backend):
    """What has no device path (here the dgc momentum memory) stages the
    whole gradient and says why, with the host path's bits."""
    host, dev = _pair("topk", "twoshot", error_feedback="dgc")
    x = rank_data(100, seed=4)
    want = host(x.copy(), key="d")
    got = dev(FakeDeviceArray(x.copy()), key="d")
    extra = dev.stats.last.extra
    assert extra["staged"] == "gradient" and "dgc" in extra["device"], extra
    assert all(COMM.allgather(bool(np.array_equal(want, got.host))))
    assert backend.to_host_calls == 1 and backend.from_host_calls == 1


def test_qsgd_elias_stages_the_gradient_and_says_why(backend):
    """qsgd's Elias coding has no device kernels: the twin refuses it, the
    call stages the gradient through the host path (its bits) and says why."""
    if "qsgd" not in TWINS:
        pytest.skip("qsgd has no device twin")
    host, dev = _pair("qsgd", "twoshot", elias=True, error_feedback=True)
    x = rank_data(300, seed=6)
    want = host(x.copy(), key="e")
    got = dev(FakeDeviceArray(x.copy()), key="e")
    extra = dev.stats.last.extra
    assert extra["staged"] == "gradient" and "elias=True" in extra["device"], extra
    assert all(COMM.allgather(bool(np.array_equal(want, got.host))))
    assert backend.to_host_calls == 1 and backend.from_host_calls == 1
