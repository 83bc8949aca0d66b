"""The device path (:mod:`hpccomm.collectives.on_device`) through every codec
with a device twin and both device algorithms, under numba's CUDA simulator.

Run by ``tests/run.py`` as its ``cudasim-nK`` runs (``mpiexec -n K`` with
``NUMBA_ENABLE_CUDASIM=1``, marker ``cudasim``): all of them at K = 1 and 3,
those also marked ``wide`` at K = 5; elsewhere these tests skip.
The "device" is host memory dressed as a CUDA array
(:mod:`hpccomm.buffers.host_device`, with ``device_kernels=True``), which
the simulator's kernels read and write in place, so the whole path runs:
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
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend
from hpccomm.errors import NonFiniteError

from .helpers import COMM, RANK, SIZE, digest, \
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


@pytest.fixture
def backend():
    b = HostDeviceBackend(device_kernels=True)     # counts every copy of the gradient
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
        got = dev(HostDeviceArray(x.copy()), key="g")
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
        got = dev(HostDeviceArray(x.copy()), key="g")
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
    out = HostDeviceArray(np.full((7, 29), np.nan, np.float32))
    got = dev(HostDeviceArray(x.copy()), key="m", out=out)
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
    got, same = raise_everywhere(lambda: dev(HostDeviceArray(x), key="nan"))
    assert same and got[0] == NonFiniteError.__name__, got
    assert backend.to_host_calls == 0


def test_fallback_stages_gradient_and_says_why(backend):
    """What has no device path (here the dgc momentum memory) stages the
    whole gradient and says why, with the host path's bits."""
    host, dev = _pair("topk", "twoshot", error_feedback="dgc")
    x = rank_data(100, seed=4)
    want = host(x.copy(), key="d")
    got = dev(HostDeviceArray(x.copy()), key="d")
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
    got = dev(HostDeviceArray(x.copy()), key="e")
    extra = dev.stats.last.extra
    assert extra["staged"] == "gradient" and "elias=True" in extra["device"], extra
    assert all(COMM.allgather(bool(np.array_equal(want, got.host))))
    assert backend.to_host_calls == 1 and backend.from_host_calls == 1


#: the stream handle the stream tests give their input (any but 0, 1, 2)
STREAM = 0xBEEF


@pytest.mark.parametrize("algorithm, gpu_aware, codecs", [
    ("twoshot", "off", TWINS), ("twoshot", "on", ["onebit", "topk"]),
    ("allgather", "off", ["onebit", "topk"])])
def test_every_launch_and_copy_on_the_input_stream(backend, algorithm, gpu_aware, codecs):
    """Input produced on stream STREAM: every kernel launch, copy and
    allocation of the call -- the reducer's NaN/Inf scan, every twin's
    encode, owner step and decode, the staging or the device buffers handed
    to MPI, the ``mean`` -- goes to that stream (the harness records them;
    the simulator has no real streams), blocking and started."""
    from .cudasim import record_streams

    for codec in codecs:
        _, dev = _pair(codec, algorithm, gpu_aware=gpu_aware, error_feedback=True, op="mean")
        for step in range(2):
            x = HostDeviceArray(rank_data(97, seed=step), stream=STREAM)
            with record_streams() as log:
                if step == 0:
                    dev(x, key="s")
                else:
                    dev.start(x, key="s").wait()
            off = [(what, s) for what, s in log if getattr(s, "handle", None) != STREAM]
            assert log and not off, (codec, step, off[:5])
            assert any(what.startswith("launch") for what, _ in log), codec


#: twins whose owner step reads GROUP received packets at once and sums the
#: ones before first (hpccomm.device_codecs._dense)
DENSE = [c for c in ("fp16", "bf16", "onebit", "terngrad", "qsgd") if c in TWINS]


@pytest.mark.wide
@pytest.mark.parametrize("codec", DENSE)
def test_owner_sums_more_packets_than_it_reads_at_once(backend, codec):
    """From 5 ranks on, a dense twin's owner step first sums the received
    packets beyond the last group of four into ``out``: the host path's bits,
    the same on every rank (``tests/run.py`` runs this at 5 ranks)."""
    if SIZE < 5:
        pytest.skip("the group pre-sum needs more than 4 packets: 5 ranks or more")
    host, dev = _pair(codec, "twoshot", error_feedback=True)
    scale = np.float32(10.0 ** (2 * (RANK % 3) - 2))   # magnitudes apart: the sum's order shows
    for step in range(2):
        x = rank_data(64 * SIZE + 3, seed=30 + step) * scale
        want = host(x.copy(), key="w")
        got = dev(HostDeviceArray(x.copy()), key="w")
        everyone = COMM.allgather((bool(np.array_equal(want.view(np.uint32),
                                                       got.host.view(np.uint32))),
                                   digest(got.host)))
        assert all(ok for ok, _ in everyone) and len({d for _, d in everyone}) == 1, step


@pytest.mark.parametrize("codec", TWINS)
def test_state_dict_round_trip_with_device_residuals(backend, codec):
    """Residuals kept on the device: ``state_dict`` holds host copies of them
    (numba device arrays have no ``copy()``), and a reducer that loads it
    continues bit for bit as the one that never stopped."""
    _, a = _pair(codec, "twoshot", error_feedback=True)
    _, b = _pair(codec, "twoshot", error_feedback=True)
    data = [rank_data(150, seed=20 + s) for s in range(3)]
    for x in data[:2]:
        a(HostDeviceArray(x.copy()), key="r")
    saved = a.state_dict()
    residuals = saved["keys"]["r"]["residuals"]
    assert residuals and all(type(v) is np.ndarray for v in residuals.values()), residuals
    b.load_state_dict(saved)
    want = a(HostDeviceArray(data[2].copy()), key="r")
    got = b(HostDeviceArray(data[2].copy()), key="r")
    assert all(COMM.allgather(bool(np.array_equal(want.host.view(np.uint32),
                                                  got.host.view(np.uint32)))))
    assert b.stats.last.extra["staged"] == "packets"


def test_a_call_on_another_stream_first_waits_for_the_last(backend):
    """The pipeline's buffers outlive a call: each call ends by recording an
    event on its stream, and a call on another stream first makes its own
    stream wait for that event (before any work of its own); calls on one
    stream need no wait.  (The simulator runs everything in order: the
    harness records the events.)"""
    from .cudasim import record_streams

    _, dev = _pair("onebit", "twoshot", error_feedback=True, nonfinite="propagate")
    calls = []
    for stream in (STREAM, STREAM, STREAM + 1):
        with record_streams() as log:
            dev(HostDeviceArray(rank_data(97), stream=stream), key="e")
        calls.append([(what, getattr(s, "handle", None)) for what, s in log])
    first, same, other = calls
    assert first[-1] == ("event record", STREAM) and same[-1] == ("event record", STREAM)
    assert "event wait" not in [what for what, _ in first + same]
    assert other[0] == ("event wait", STREAM + 1), other[:3]
    assert other[-1] == ("event record", STREAM + 1)
