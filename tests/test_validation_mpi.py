"""Bad input raises the same clear error on every rank -- never a hang.

Each test makes one or more ranks misbehave and checks that *every* rank
raised, with the same exception class and message."""
import numpy as np
import pytest

import hpccomm
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend
from hpccomm.errors import ConsistencyError, NonFiniteError

from .helpers import COMM, RANK, SIZE, raise_everywhere, rank_data

pytestmark = pytest.mark.mpi


def expect_everywhere(fn, exc_type, fragment):
    (name, message), agreed = raise_everywhere(fn)
    assert name == exc_type.__name__, (name, message)
    assert fragment in message, message
    assert agreed, "ranks raised different errors"


@pytest.mark.mpi(min_size=2)
def test_mismatched_lengths():
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(10 + (RANK == 1), np.float32)),
                      ConsistencyError, "n=11")


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtypes():
    dt = np.float64 if RANK == SIZE - 1 else np.float32
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, dt)), ConsistencyError,
                      "dtype=float64")


@pytest.mark.mpi(min_size=2)
def test_mismatched_op():
    op = "mean" if RANK == 0 else "sum"
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), op=op),
                      ConsistencyError, "op=mean")


@pytest.mark.mpi(min_size=2)
def test_mismatched_keys():
    r = hpccomm.Allreducer()
    expect_everywhere(lambda: r(np.zeros(4, np.float32), key=f"k{RANK % 2}"), ConsistencyError,
                      "key='k1'")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["always", "first"])
def test_an_unhashable_key_on_one_rank(check):
    r = hpccomm.Allreducer(check=check)
    key = ["k"] if RANK == 0 else "k"
    expect_everywhere(lambda: r(np.zeros(4, np.float32), key=key), TypeError,
                      "rank 0: key must be a string, not list")


@pytest.mark.mpi(min_size=2)
def test_unknown_codec_on_one_rank():
    codec = "nosuchcodec" if RANK == 1 else "none"
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), codec=codec),
                      ValueError, "rank 1: unknown codec 'nosuchcodec'")


def test_bad_op_everywhere():
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), op="max"),
                      ValueError, "op must be one of")


def test_bad_check_and_gpu_aware():
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), check="sometimes"),
                      ValueError, "check must be one of")
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), gpu_aware="maybe"),
                      ValueError, "gpu_aware must be")


def test_unknown_option():
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), frobnicate=3),
                      TypeError, "unknown option 'frobnicate'")


def test_wrong_dtype_on_last_rank():
    dt = np.int32 if RANK == SIZE - 1 else np.float32
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, dt)), TypeError,
                      f"rank {SIZE - 1}: unsupported dtype int32")


def test_not_an_array():
    x = [1.0, 2.0] if RANK == 0 else np.zeros(2, np.float32)
    expect_everywhere(lambda: hpccomm.allreduce(x), TypeError, "rank 0: cannot reduce a list")


def test_non_contiguous_input():
    base = np.zeros((4, 4), np.float32)
    x = base[:, 1] if RANK == 0 else np.zeros(4, np.float32)
    expect_everywhere(lambda: hpccomm.allreduce(x), ValueError, "not C-contiguous")


def test_out_of_wrong_size():
    out = np.empty(3 if RANK == 0 else 4, np.float32)
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), out=out), ValueError,
                      "rank 0: out has 3")


def test_lossy_codec_with_the_dense_algorithm():
    # algorithm "mpi" sends raw values: it refuses any codec but "none"
    class Lossy(hpccomm.Codec):
        name = "test-lossy-f32"
        codec_id = 250

    hpccomm.register_codec(Lossy)
    expect_everywhere(lambda: hpccomm.allreduce(np.zeros(4, np.float32), codec="test-lossy-f32",
                                                algorithm="mpi"),
                      ValueError, "algorithm 'mpi' sends dense values")


def test_nonfinite_policy_raise_when_codec_says_so():
    class Strict(hpccomm.get_codec("none").__class__):
        name = "test-none-strict"
        codec_id = 251

        def __init__(self):
            super().__init__(nonfinite="raise")

    hpccomm.register_codec(Strict)
    x = rank_data(8)
    if RANK == SIZE - 1:
        x[3] = np.nan
    from hpccomm.collectives.base import register_algorithm
    from hpccomm.collectives.mpi import MpiAllreduce

    class DenseAny(MpiAllreduce):
        name = "test-dense-any"

        def check_codec(self, codec):
            pass

    register_algorithm(DenseAny)
    expect_everywhere(lambda: hpccomm.allreduce(x, codec="test-none-strict",
                                                algorithm="test-dense-any"),
                      NonFiniteError, f"rank {SIZE - 1}: input holds 1 NaN/Inf")


def test_nan_propagates_with_dense_mpi():
    """codec 'none' + 'mpi' follows MPI: NaN in, NaN out, on every rank."""
    x = np.zeros(4, np.float32)
    if RANK == 0:
        x[1] = np.nan
    res = hpccomm.allreduce(x)
    flags = COMM.allgather(bool(np.isnan(res[1])) and not np.isnan(res[0]))
    assert all(flags)


def test_error_then_recovery():
    """After an agreed error the communicator is still usable."""
    r = hpccomm.Allreducer()
    bad = np.zeros(3, np.int64) if RANK == 0 else np.zeros(3, np.float32)
    expect_everywhere(lambda: r(bad, key="w"), TypeError, "unsupported dtype int64")
    res = r(np.ones(3, np.float32), key="w")
    np.testing.assert_array_equal(res, np.full(3, SIZE, np.float32))


@pytest.mark.parametrize("codec", ["onebit", "topk", "fp16"])
def test_nan_counted_by_the_fused_encode_is_raised_everywhere(codec):
    """With error feedback and a fused codec, NaN/Inf are counted in the
    encode's own pass and the cross-rank check waits for it (the input is
    not scanned separately): every rank raises the same error, counted over
    the whole input (two bad values in different chunks), before anything is
    sent, and the residuals stay as they were."""
    n = 3 * 4096 * SIZE + 5
    x = rank_data(n)
    bad = x.copy()
    if RANK == SIZE - 1:
        bad[1], bad[n - 2] = np.nan, -np.inf
    used = hpccomm.Allreducer(codec=codec, algorithm="twoshot", error_feedback=True)
    clean = hpccomm.Allreducer(codec=codec, algorithm="twoshot", error_feedback=True)
    used(x, key="k")
    clean(x, key="k")
    assert used._defers_check(hpccomm.buffers.as_buffer(bad)), "the check is not deferred"
    expect_everywhere(lambda: used(bad, key="k"), NonFiniteError,
                      f"rank {SIZE - 1}: input holds 2 NaN/Inf value(s); codec '{codec}'")
    assert used(x, key="k").tobytes() == clean(x, key="k").tobytes()


@pytest.mark.parametrize("codec,algorithm", [("none", "mpi"), ("onebit", "twoshot"),
                                             ("topk", "sparse_split"), ("bf16", "allgather")])
def test_read_only_out_on_one_rank(codec, algorithm):
    out = np.empty(100, np.float32)
    if RANK == SIZE - 1:
        out.flags.writeable = False
    r = hpccomm.Allreducer(codec=codec, algorithm=algorithm)
    expect_everywhere(lambda: r(rank_data(100), out=out), ValueError,
                      f"rank {SIZE - 1}: out is read-only")


def test_nan_in_bfloat16_input_on_one_rank():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rank_data(64)).to(torch.bfloat16)
    if RANK == SIZE - 1:
        x[5] = float("nan")
        x[9] = float("-inf")
    for codec, algorithm in [("onebit", "twoshot"), ("bf16", "allgather")]:
        r = hpccomm.Allreducer(codec=codec, algorithm=algorithm)
        expect_everywhere(lambda: r(x, key="k"), NonFiniteError,
                          f"rank {SIZE - 1}: input holds 2 NaN/Inf")


@pytest.mark.parametrize("gpu_aware", ["off", "on"])
def test_nan_in_device_input_on_one_rank(gpu_aware):
    
    backend = HostDeviceBackend()
    hpccomm.register_device_backend(backend)
    try:
        host = rank_data(50)
        if RANK == 0:
            host[49] = np.inf
        r = hpccomm.Allreducer(codec="onebit", algorithm="twoshot", gpu_aware=gpu_aware)
        expect_everywhere(lambda: r(HostDeviceArray(host), key="d"), NonFiniteError,
                          "rank 0: input holds 1 NaN/Inf")
    finally:
        hpccomm.unregister_device_backend(backend)


def test_a_key_whose_size_changes_is_refused_everywhere():
    r = hpccomm.Allreducer(codec="onebit", algorithm="twoshot")
    r(rank_data(100), key="k")
    expect_everywhere(lambda: r(rank_data(200), key="k"), ValueError,
                      "key 'k' names a tensor of 100 elements, this call has 200")
    assert r.state_dict()["keys"]["k"]["residuals"], "the refused call dropped the residual"
    r.reset("k")
    assert r(rank_data(200), key="k").shape == (200,)


def test_a_state_dict_of_another_rank_or_size_is_refused_everywhere():
    r = hpccomm.Allreducer(codec="onebit", algorithm="twoshot")
    r(rank_data(100), key="k")
    mine = r.state_dict()
    other = COMM.bcast(mine, root=SIZE - 1)            # every rank gets the last rank's
    if SIZE > 1:
        expect_everywhere(lambda: r.load_state_dict(other), ValueError,
                          f"rank 0: state_dict was saved by rank {SIZE - 1} of {SIZE}, "
                          f"this is rank 0 of {SIZE}")
    bigger = dict(mine, size=SIZE + 1)
    expect_everywhere(lambda: r.load_state_dict(bigger), ValueError,
                      f"state_dict was saved by rank {RANK if SIZE == 1 else 0} of {SIZE + 1}")
    r.load_state_dict(mine)                              # its own is accepted
    assert r(rank_data(100), key="k").shape == (100,)


def test_error_feedback_in_the_stateless_allreduce_is_refused_everywhere():
    expect_everywhere(lambda: hpccomm.allreduce(rank_data(10), codec="onebit",
                                                algorithm="twoshot", error_feedback=True),
                      TypeError, "hpccomm.allreduce is stateless and takes no error_feedback")


@pytest.mark.parametrize("algorithm", ["sparse_rd", "sparse_allgather", "kylix"])
@pytest.mark.parametrize("codec", ["onebit", "qsgd", "bf16"])
def test_sparse_algorithms_refuse_dense_codecs(codec, algorithm):
    expect_everywhere(lambda: hpccomm.allreduce(rank_data(10), codec=codec, algorithm=algorithm),
                      ValueError, f"algorithm {algorithm!r} sends (index, value) pairs")


def test_threshold_on_summable_without_tau_names_tau():
    expect_everywhere(lambda: hpccomm.allreduce(rank_data(10), codec="threshold",
                                                algorithm="summable"),
                      ValueError, "'threshold' is not here: it is summable only with a fixed tau=")
    got = hpccomm.allreduce(np.full(10, 2.0, np.float32), codec="threshold", tau=1.0,
                            algorithm="summable")
    np.testing.assert_array_equal(got, np.full(10, SIZE, np.float32))   # one quantum each
