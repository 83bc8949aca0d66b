"""The public API on real MPI: correctness, rank identity, dtypes, buffers,
state and statistics.  Run under mpiexec with several rank counts."""
import numpy as np
import pytest

import hpccomm
from hpccomm.buffers import bf16_bits_to_f32, f32_to_bf16_bits
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend

from .helpers import (COMM, RANK, SIZE, exact_sum, raise_everywhere,
                      rank_data, same_on_all_ranks)

pytestmark = pytest.mark.mpi

# lengths: empty, one element, fewer than ranks, not multiples of P / 8 / 32
LENGTHS = [0, 1, 2, 7, 31, 33, 1000, 4097]


@pytest.mark.parametrize("n", LENGTHS)
def test_sum_matches_exact(n):
    x = rank_data(n, integers=True)
    res = hpccomm.allreduce(x)
    same = same_on_all_ranks(res)
    assert res.dtype == np.float32 and res.shape == (n,)
    np.testing.assert_array_equal(res, exact_sum(n, integers=True).astype(np.float32))
    assert same


@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_mean_divides_once(n):
    x = rank_data(n, integers=True)
    res = hpccomm.allreduce(x, op="mean")
    same = same_on_all_ranks(res)
    expected = exact_sum(n, integers=True).astype(np.float32)
    np.divide(expected, np.float32(SIZE), out=expected)
    np.testing.assert_array_equal(res, expected)
    assert same


def test_float_input_bit_identical_and_close():
    n = 10007
    x = rank_data(n)
    res = hpccomm.allreduce(x)
    same = same_on_all_ranks(res)
    np.testing.assert_allclose(res, exact_sum(n), rtol=1e-5, atol=1e-5 * SIZE)
    assert same


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (1,), ()])
def test_shape_is_kept(shape):
    x = np.full(shape, RANK + 1, dtype=np.float32)
    res = hpccomm.allreduce(x)
    assert res.shape == x.shape
    np.testing.assert_array_equal(res, np.full(shape, SIZE * (SIZE + 1) / 2, dtype=np.float32))


def test_float64_is_reduced_natively():
    x = np.full(17, 1.0 + 2.0 ** -40, dtype=np.float64)
    res = hpccomm.allreduce(x)
    assert res.dtype == np.float64
    np.testing.assert_array_equal(res, np.full(17, SIZE * (1.0 + 2.0 ** -40)))


def test_float16_is_widened_and_rounded_back():
    x = np.full(9, 0.5 * (RANK + 1), dtype=np.float16)
    res = hpccomm.allreduce(x)
    assert res.dtype == np.float16
    np.testing.assert_array_equal(res, np.full(9, 0.5 * SIZE * (SIZE + 1) / 2, dtype=np.float16))


@pytest.mark.narrow      # ml_dtypes' bfloat16: a buffer adapter
def test_bfloat16_bits_roundtrip_and_reduce():
    # bfloat16 arrives as torch/ml_dtypes data; the host helpers are what both use
    vals = np.array([0.0, 1.0, -2.5, 3.140625, 65280.0], dtype=np.float32)
    assert np.array_equal(bf16_bits_to_f32(f32_to_bf16_bits(vals)), vals)
    # nearest-even rounding: 1 + 2^-8 is a tie between 1 and 1 + 2^-7
    tie = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], dtype=np.float32)
    assert np.array_equal(bf16_bits_to_f32(f32_to_bf16_bits(tie)),
                          np.array([1.0, 1.0 + 2 * 2.0 ** -7], dtype=np.float32))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.full(5, RANK + 1, dtype=ml_dtypes.bfloat16)
    res = hpccomm.allreduce(x)
    assert res.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(res.astype(np.float32), np.full(5, SIZE * (SIZE + 1) / 2))


def test_out_argument_and_in_place():
    x = rank_data(100, integers=True)
    out = np.empty_like(x)
    res = hpccomm.allreduce(x, out=out)
    expected = exact_sum(100, integers=True).astype(np.float32)
    assert res is out
    np.testing.assert_array_equal(out, expected)
    y = x.copy()
    res2 = hpccomm.allreduce(y, out=y)  # in place
    assert res2 is y
    np.testing.assert_array_equal(y, expected)


def test_allreducer_state_stats_and_keys():
    r = hpccomm.Allreducer(codec="none", algorithm="mpi", op="sum")
    x = rank_data(1000)
    a = r(x, key="layer1.weight")
    b = r(x.reshape(10, 100), key="layer1.weight")
    assert b.shape == (10, 100)
    np.testing.assert_array_equal(a, b.reshape(-1))
    assert r.stats.calls == 2
    assert r.stats.last.n == 1000 and r.stats.last.nbytes == 4000
    expected_bytes = 2 * (SIZE - 1) * 4000 // SIZE
    assert r.stats.last.bytes_sent == expected_bytes
    assert r.stats.bytes_sent == 2 * expected_bytes
    assert r.stats.t_total > 0
    sd = r.state_dict()
    assert sd["keys"]["layer1.weight"]["step"] == 2
    r2 = hpccomm.Allreducer(codec="none", algorithm="mpi")
    r2.load_state_dict(sd)
    assert r2.state_dict()["keys"]["layer1.weight"]["step"] == 2
    r2.reset()
    assert r2.state_dict()["keys"] == {}


@pytest.mark.parametrize("codec", ["onebit", "none"])
def test_max_keys_forgets_the_key_called_least_recently(codec):
    """A bound of two keys: a, b, a, then c forgets b (not a, called since);
    b's next call starts afresh, bit for bit as a new reducer's first call;
    the lean path (codec none) counts as a use too."""
    r = hpccomm.Allreducer(codec=codec, max_keys=2)
    data = {k: [rank_data(300, seed=10 * i + s) for s in range(3)]
            for i, k in enumerate("abc")}
    r(data["a"][0], key="a")
    r(data["b"][0], key="b")
    r(data["a"][1], key="a")
    r(data["c"][0], key="c")
    kept = r.keys()
    steps = {k: v["step"] for k, v in r.state_dict()["keys"].items()}
    again = r(data["b"][1], key="b")        # back, as new: forgets a (c is more recent)
    fresh = hpccomm.Allreducer(codec=codec)(data["b"][1], key="b")
    after = r.keys()
    same = same_on_all_ranks(np.array([ord(k) for k in kept + after]))
    assert kept == ["a", "c"] and steps == {"a": 2, "c": 1}
    if codec == "onebit":      # residuals (and spares) of 300 float32 per key kept
        residuals = sum(v["residuals"]["worker"].nbytes
                        for v in r.state_dict()["keys"].values())
        assert r.state_nbytes() >= residuals == 2 * 300 * 4
    assert after == ["c", "b"]
    np.testing.assert_array_equal(again, fresh)
    assert same
    r.reset()
    assert r.state_nbytes() == 0 and r.keys() == []


def test_max_keys_must_be_a_positive_int_on_every_rank():
    bad = 0 if RANK == SIZE - 1 else 4
    r = hpccomm.Allreducer(codec="onebit", max_keys=bad)
    (name, message), agreed = raise_everywhere(lambda: r(rank_data(8), key="k"))
    assert agreed and name == "ValueError"
    assert message == f"rank {SIZE - 1}: max_keys must be a positive int or None, not 0"


def test_check_first_skips_agreement_after_first_call():
    r = hpccomm.Allreducer(check="first")
    x = rank_data(64, integers=True)
    for _ in range(3):
        res = r(x, key="k")
    np.testing.assert_array_equal(res, exact_sum(64, integers=True).astype(np.float32))


def test_registries_are_exposed():
    assert "none" in hpccomm.available_codecs()
    assert "mpi" in hpccomm.available_algorithms()
    assert set(hpccomm.__all__) >= {"allreduce", "Allreducer", "available_codecs",
                                    "available_algorithms"}


@pytest.mark.parametrize("gpu_aware", ["on", "off"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_cuda_array_interface_buffers(gpu_aware, op):
    """Objects with __cuda_array_interface__ go to MPI directly (gpu_aware on)
    or through reused host staging buffers (off); the producing stream is
    synchronized first."""
    backend = HostDeviceBackend()
    hpccomm.register_device_backend(backend)
    try:
        x = HostDeviceArray(rank_data(33, integers=True).reshape(3, 11), stream=7)
        r = hpccomm.Allreducer(gpu_aware=gpu_aware, op=op)
        res = r(x, key="g")
        res_again = r(x, key="g")
    finally:
        hpccomm.unregister_device_backend(backend)
    expected = exact_sum(33, integers=True).astype(np.float32).reshape(3, 11)
    if op == "mean":
        expected /= np.float32(SIZE)
    assert isinstance(res, HostDeviceArray)
    np.testing.assert_array_equal(res.host, expected)
    np.testing.assert_array_equal(res_again.host, expected)
    assert x.synced == 2
    if gpu_aware == "off":
        assert backend.to_host_calls == 2 and backend.from_host_calls == 2
        assert len(backend.pinned) == 2  # staging buffers reused on the second call
        assert r.stats.last.extra.get("staged")
    else:
        assert backend.to_host_calls == 0


def test_dlpack_objects_on_host():
    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = rank_data(10, integers=True)
    res = hpccomm.allreduce(Wrapped(x))
    np.testing.assert_array_equal(res, exact_sum(10, integers=True).astype(np.float32))


@pytest.mark.narrow      # torch tensors: a buffer adapter (torch costs each rank 1.5 s)
def test_torch_tensors_if_available():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rank_data(12, integers=True)).reshape(3, 4)
    res = hpccomm.allreduce(x)
    assert isinstance(res, torch.Tensor) and tuple(res.shape) == (3, 4)
    np.testing.assert_array_equal(res.numpy().reshape(-1),
                                  exact_sum(12, integers=True).astype(np.float32))
    xb = torch.full((4,), float(RANK + 1), dtype=torch.bfloat16)
    rb = hpccomm.allreduce(xb)
    assert rb.dtype == torch.bfloat16
    np.testing.assert_array_equal(rb.float().numpy(), np.full(4, SIZE * (SIZE + 1) / 2))


def test_comm_subsets():
    """A communicator other than COMM_WORLD (odd/even split)."""
    sub = COMM.Split(RANK % 2, RANK)
    try:
        x = np.full(5, RANK, dtype=np.float32)
        res = hpccomm.allreduce(x, sub)
        members = [r for r in range(SIZE) if r % 2 == RANK % 2]
        np.testing.assert_array_equal(res, np.full(5, sum(members), dtype=np.float32))
    finally:
        sub.Free()


# -- the call a user writes first: a codec and no algorithm ------------------

@pytest.mark.parametrize("codec", ["onebit", "topk", "qsgd", "bf16"])
def test_a_codec_without_an_algorithm_compresses(codec):
    # the one-line call sends the codec's packets through twoshot: the same
    # bits as naming twoshot, and fewer bytes than the dense values
    n = 4097
    x = rank_data(n)
    res = hpccomm.allreduce(x, codec=codec)
    same = same_on_all_ranks(res)
    np.testing.assert_array_equal(res, hpccomm.allreduce(x, codec=codec, algorithm="twoshot"))
    assert same
    reducer = hpccomm.Allreducer(codec=codec)
    assert reducer.config_error is None and reducer.algorithm.name == "twoshot"
    reducer(x, key="g")
    if SIZE > 1:
        assert 0 < reducer.stats.last.bytes_sent < x.nbytes


def test_default_algorithms_by_codec():
    for codec in [c for c in hpccomm.available_codecs() if not c.startswith("test-")]:
        reducer = hpccomm.Allreducer(codec=codec)
        want = {"none": "mpi", "powersgd": "powersgd"}.get(codec, "twoshot")
        assert reducer.config_error is None, (codec, reducer.config_error)
        assert reducer.algorithm.name == want, codec
    assert hpccomm.Allreducer(codec="qsgd+rotate").algorithm.name == "twoshot"
    assert hpccomm.Allreducer(codec=hpccomm.get_codec("topk", ratio=0.1)).algorithm.name == "twoshot"


def test_a_lossy_codec_named_with_mpi_still_raises_everywhere():
    with pytest.raises(ValueError, match="algorithm 'mpi' sends dense values"):
        hpccomm.allreduce(rank_data(8), codec="onebit", algorithm="mpi")
