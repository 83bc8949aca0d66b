"""On a real GPU, under mpiexec: the device path (encode, owner step,
decode on the device; packets through MPI) of every codec with a device twin,
through ``twoshot`` and ``allgather``, against the host path of the same
configuration -- bit for bit on every rank, the same bits on all ranks.
``./dev.sh gpu`` runs it at 1, 2 and 5 ranks sharing one GPU (at 5, the
owner step sums more received packets than its kernels read at once)::

    mpiexec -n 5 python -m pytest -q -m "gpu and mpi" --with-mpi tests/test_gpu_mpi.py

Under ``NUMBA_ENABLE_CUDASIM=1`` the same at tiny sizes on the simulator
(``./dev.sh gpu --simulate``); without either, the tests skip.
"""
import pytest

import hpccomm

from . import gpu
from .gpu import KINDS, MISSING, MODE, SIM
from .helpers import COMM, digest, rank_data
from .test_gpu import PARAMS, _same

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.skipif(not MODE, reason=MISSING or "-")]

#: elements per call (an odd count: ragged chunks)
N = 203 if SIM else (1 << 18) + 3


def _twins():
    if not MODE:
        return []
    from hpccomm.device_codecs import device_codec_names

    return device_codec_names()


@pytest.fixture
def sim_backend():
    backend = gpu.register_sim_backend()
    yield backend
    gpu.unregister(backend)


@pytest.mark.parametrize("kind", KINDS[:1])
@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
@pytest.mark.parametrize("codec", _twins())
def test_device_path_matches_host(sim_backend, codec, algorithm, kind):
    """Three steps of one key with error feedback (residuals kept on the
    device, worker's and owner's): device result == host result, the same
    on every rank; only packets were staged."""
    opts = dict(PARAMS.get(codec, {}), error_feedback=True, op="mean")
    host = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, **opts)
    dev = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, **opts)
    for step in range(3):
        x = rank_data(N, seed=step)
        want = host(x.copy(), key="g")
        got = gpu.host(dev(gpu.device_array(x, kind), key="g"))
        everyone = COMM.allgather((_same(got, want), digest(got),
                                   dev.stats.last.extra.get("staged")))
        assert all(ok for ok, _, _ in everyone), (codec, algorithm, step)
        assert len({d for _, d, _ in everyone}) == 1
        assert all(s == "packets" for _, _, s in everyone), everyone


@pytest.mark.parametrize("kind", KINDS)
def test_torch_and_cupy_buffers_agree_across_ranks(sim_backend, kind):
    """Each buffer kind through the default reducer of a lossy codec with a
    started call: the host path's bits on every rank."""
    host = hpccomm.Allreducer(COMM, codec="qsgd", algorithm="twoshot", bits=4)
    dev = hpccomm.Allreducer(COMM, codec="qsgd", algorithm="twoshot", bits=4)
    x = rank_data(N, seed=9)
    want = host(x.copy(), key="k")
    got = gpu.host(dev.start(gpu.device_array(x, kind), key="k").wait())
    assert all(COMM.allgather(_same(got, want)))
