"""Every codec through the PyTorch helper and through device buffers: the same
bits as the plain Allreducer on host arrays (itself checked against the
single-process simulation in ``test_collectives_mpi``), on every rank, over
steps that carry error-feedback residuals."""
import numpy as np
import pytest

import hpccomm
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend

from .helpers import COMM, SIZE, digest, rank_data, \
    same_on_all_ranks
from .test_collectives_mpi import CODEC_PARAMS, CODECS, SEED

# narrow: layers above the collectives (the PyTorch helper, device buffers), whose
# collectives tests/test_collectives_mpi.py runs at every rank count
pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

STEPS = 3


def options(codec):
    return dict(CODEC_PARAMS.get(codec, {}), seed=SEED)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("codec", CODECS)
def test_grad_reducer_equals_the_allreducer_on_each_bucket(codec, overlap):
    """Backward fills the gradients (with ``overlap=True`` the hooks start the
    buckets during it); a copy of the model without hooks gives the same
    gradients to reduce bucket by bucket with the plain reducers."""
    torch = pytest.importorskip("torch")
    import copy

    from hpccomm.torch_grads import GradReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 9))
    plain = copy.deepcopy(model)
    gr = GradReducer(model, COMM, codec=codec, algorithm="twoshot", op="mean", min_compress=200,
                     bucket_bytes=3000, overlap=overlap, **options(codec))
    ref = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", op="mean", **options(codec))
    dense = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi", op="mean")
    params = dict(model.named_parameters())
    for step in range(STEPS):
        x = torch.from_numpy(rank_data(16 * 40, seed=step).reshape(16, 40))
        plain.zero_grad()
        plain(x).square().sum().backward()
        grads = {n: p.grad.numpy().copy() for n, p in plain.named_parameters()}
        model.zero_grad(set_to_none=False)
        model(x).square().sum().backward()
        gr.finish() if overlap else gr()
        for b in gr.buckets:
            flat = np.concatenate([grads[n].reshape(-1) for n in b.names]).reshape(b.shape)
            want = (dense if b.dense else ref)(flat, key=b.key)
            got = np.concatenate([params[n].grad.numpy().reshape(-1) for n in b.names])
            assert digest(got) == digest(want.reshape(-1)), (step, b.key)
            assert same_on_all_ranks(got)
    assert any(not b.dense for b in gr.buckets)


@pytest.mark.parametrize("gpu_aware", ["off", "on"])
@pytest.mark.parametrize("codec", CODECS)
def test_device_buffers_equal_host_arrays(codec, gpu_aware):
    backend = HostDeviceBackend()
    hpccomm.register_device_backend(backend)
    try:
        dev = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", gpu_aware=gpu_aware,
                                 **options(codec))
        host = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", **options(codec))
        for step in range(STEPS):
            x = rank_data(1001, seed=step).reshape(7, 143)
            got = dev(HostDeviceArray(x.copy()), key="g")
            assert isinstance(got, HostDeviceArray)
            want = host(x, key="g")
            assert digest(got.host) == digest(want), step
        assert same_on_all_ranks(got.host)
        assert SIZE == 1 or dev.stats.bytes_sent == host.stats.bytes_sent
    finally:
        hpccomm.unregister_device_backend(backend)
