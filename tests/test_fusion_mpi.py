"""Fusion buckets, the PyTorch helper and short training runs, on real MPI."""
import numpy as np
import pytest

import hpccomm
from hpccomm.fusion import GradientBuckets, plan_buckets

from .helpers import COMM, SIZE, rank_data

pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

SHAPES = {"conv.weight": (8, 3, 5, 5), "conv.bias": (8,), "fc1.weight": (600, 40),
          "fc1.bias": (40,), "fc2.weight": (40, 10), "fc2.bias": (10,), "scale": ()}


def test_plan_filters_and_bounds():
    plan = plan_buckets(SHAPES, bucket_bytes=64 << 10, min_compress=500, dense=("fc2.weight",))
    dense = {n for b in plan if b.dense for n in b.names}
    compressed = [b for b in plan if not b.dense]
    assert dense == {"conv.bias", "fc1.bias", "fc2.bias", "scale", "fc2.weight"}
    assert {n for b in compressed for n in b.names} == {"conv.weight", "fc1.weight"}
    for b in compressed:  # a tensor larger than the limit gets a bucket of its own
        assert 4 * b.numel <= 64 << 10 or len(b.names) == 1
    assert len({b.key for b in plan}) == len(plan)
    per_tensor = plan_buckets(SHAPES, bucket_bytes=0, min_compress=500)
    assert [b.shape for b in per_tensor if not b.dense] == [(8, 3, 5, 5), (600, 40)]
    with pytest.raises(KeyError):
        plan_buckets(SHAPES, dense=("nosuch",))


@pytest.mark.parametrize("bucket_bytes", [0, 4096, 1 << 20])
def test_bucket_round_trip_is_exact(bucket_bytes):
    """Every gradient gets exactly its own reduced value (codec none)."""
    grads = {k: rank_data(int(np.prod(s)) if s else 1, seed=i, integers=True).reshape(s)
             for i, (k, s) in enumerate(SHAPES.items())}
    expected = {}
    for k, g in grads.items():
        total = np.empty_like(g.reshape(-1))
        COMM.Allreduce(g.reshape(-1).copy(), total)
        expected[k] = total.reshape(g.shape)
    reducer = hpccomm.Allreducer(codec="none", algorithm="twoshot")
    buckets = GradientBuckets(SHAPES, reducer, bucket_bytes=bucket_bytes, min_compress=100)
    buckets.reduce(grads)
    for k in SHAPES:
        np.testing.assert_array_equal(grads[k], expected[k], err_msg=k)
    assert buckets.bytes_sent >= 0
    # communication only; the whole time in the reducers includes encode and decode
    stats = (reducer.stats, buckets.dense_reducer.stats)
    assert buckets.comm_time == sum(s.t_comm for s in stats)
    assert buckets.reduce_time == sum(s.t_total for s in stats)


def test_buckets_reject_wrong_shapes():
    reducer = hpccomm.Allreducer()
    buckets = GradientBuckets({"a": (4, 4)}, reducer, min_compress=1)
    with pytest.raises(ValueError, match="shape"):
        buckets.reduce({"a": np.zeros((16,), np.float32)})
    with pytest.raises(KeyError, match="missing"):
        buckets.reduce({})


@pytest.mark.parametrize("integers", [True, False])
def test_torch_helper_matches_mpi_allreduce(integers):
    """codec="none" against plain MPI_Allreduce: bit-exact on integer-valued gradients (any
    summation order is exact), within reassociation error on float ones (MPI_Allreduce picks its
    own summation order, hpccomm sums in rank order)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
    from hpccomm.torch_grads import GradReducer

    reducer = GradReducer(model, COMM, codec="none", algorithm="twoshot", op="mean",
                          min_compress=100, bucket_bytes=4096)
    results = []
    for step in range(2):
        grads = {}
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.from_numpy(rank_data(p.numel(), seed=10 * step + i, integers=integers)
                                 .reshape(tuple(p.shape)))
            if step == 1 and i == 0:
                p.grad = g.clone()  # replaced tensor: must be copied in, still correct
            else:
                p.grad.copy_(g)
            grads[name] = g.numpy().copy()
        copies = reducer()
        for name, p in model.named_parameters():
            want = np.empty_like(grads[name])
            COMM.Allreduce(grads[name], want)
            want /= np.float32(SIZE)
            if integers:
                results.append(np.array_equal(p.grad.numpy(), want))
            else:
                results.append(np.allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-6 * SIZE))
        results.append(copies == (1 if step == 1 else 0))
    assert all(results), results


@pytest.mark.parametrize("codec", [c for c in ("none", "onebit", "topk", "terngrad")
                                   if c in hpccomm.available_codecs()])
def test_short_training_run_learns_and_stays_identical(codec):
    pytest.importorskip("sklearn")
    import argparse

    from hpccomm.bench.datasets import load_dataset
    from hpccomm.bench.train import build_parser, resolve, train_numpy

    args = build_parser().parse_args(["--epochs", "3", "--batch", "16"])
    args.hidden = [32]
    args.options = {"ratio": 0.1} if codec == "topk" else {}
    assert isinstance(args, argparse.Namespace)
    data = load_dataset("digits")
    algorithm = "mpi" if codec == "none" else "twoshot"
    r = train_numpy(COMM, data, codec, algorithm, seed=1, args=resolve(args, codec))
    first, last = r["history"][0], r["history"][-1]
    assert r["weights_identical"]
    assert last["train_loss"] < first["train_loss"]
    assert last["val"] > 0.5 and r["test"] > 0.5


def test_stale_training_run_learns_and_stays_identical():
    """``--staleness 2``: two steps behind, the MLP still learns, the ranks
    agree bit for bit, and the weights are not the synchronous run's."""
    pytest.importorskip("sklearn")
    from hpccomm.bench.datasets import load_dataset
    from hpccomm.bench.train import build_parser, resolve, train_numpy

    data = load_dataset("digits")
    runs = {}
    for s in (0, 2):
        args = build_parser().parse_args(["--epochs", "3", "--batch", "16", "--staleness", str(s)])
        args.hidden, args.options = [32], {}
        runs[s] = train_numpy(COMM, data, "onebit", "twoshot", seed=1,
                              args=resolve(args, "onebit"))
    r = runs[2]
    assert r["weights_identical"] and r["steps"] == runs[0]["steps"]
    assert r["history"][-1]["train_loss"] < r["history"][0]["train_loss"] and r["test"] > 0.5
    assert r["digest"] != runs[0]["digest"]


def test_gradient_probe_sees_what_the_codec_does():
    """The probe's exact mean against the reduced gradient: ~0 for fp32, a
    large per-step error for onebit that error feedback keeps from adding up."""
    pytest.importorskip("sklearn")
    from hpccomm.bench.datasets import load_dataset
    from hpccomm.bench.train import build_parser, resolve, train_numpy

    data = load_dataset("digits")
    probes = {}
    for codec, ef in (("none", "auto"), ("onebit", "on"), ("onebit", "off")):
        args = build_parser().parse_args(["--epochs", "1", "--probe-every", "1",
                                          "--error-feedback", ef])
        args.hidden, args.options = [32], {}
        algorithm = "mpi" if codec == "none" else "twoshot"
        r = train_numpy(COMM, data, codec, algorithm, seed=1, args=resolve(args, codec))
        probes[codec, ef] = r["probe"]
    assert probes["none", "auto"]["probed_steps"] > 10
    assert probes["none", "auto"]["step_rel_err"] < 1e-5
    if SIZE > 1:
        assert probes["onebit", "on"]["step_rel_err"] > 0.1
        assert (probes["onebit", "on"]["cumulative_rel_err"]
                < probes["onebit", "off"]["cumulative_rel_err"])
