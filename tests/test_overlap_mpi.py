"""Overlap: ``GradReducer(overlap=True)`` starts each bucket from backward's
hooks and gives the weights of ``overlap=False`` bit for bit; the numpy
buckets' ``start``/``finish`` give ``reduce``'s results."""
import numpy as np
import pytest

import hpccomm
from hpccomm.fusion import GradientBuckets

from .helpers import COMM, RANK, digest, rank_data, same_on_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.narrow]


def train(overlap, codec, algorithm, steps=4, set_to_none=False, unused=False):
    torch = pytest.importorskip("torch")
    from hpccomm.torch_grads import GradReducer

    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(),
              torch.nn.Linear(40, 5)]
    model = torch.nn.Sequential(*layers)
    spare = torch.nn.Linear(8, 64)            # gets no gradient when unused=True
    params = list(model.named_parameters()) + [("spare." + n, p)
                                              for n, p in spare.named_parameters()]
    reducer = GradReducer(params, COMM, codec=codec, algorithm=algorithm, op="mean",
                          min_compress=200, bucket_bytes=4096, overlap=overlap)
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    rng = np.random.default_rng([7, RANK])
    started = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.from_numpy(rng.standard_normal((16, 24)).astype(np.float32))
        loss = model(x).square().mean()
        if not unused:
            loss = loss + spare(x[:, :8]).square().mean()
        loss.backward()
        started.append(reducer.started)
        reducer()
        opt.step()
    reducer.started_during_backward = started
    return [digest(p.detach().numpy()) for _, p in params], reducer


@pytest.mark.parametrize("codec,algorithm", [("none", "mpi"), ("onebit", "twoshot"),
                                             ("topk", "allgather"), ("qsgd", "twoshot")])
@pytest.mark.parametrize("variant", ["views", "set_to_none", "unused"])
def test_overlap_gives_the_same_weights(codec, algorithm, variant):
    opts = {"set_to_none": variant == "set_to_none", "unused": variant == "unused"}
    want, plain = train(False, codec, algorithm, **opts)
    got, over = train(True, codec, algorithm, **opts)
    assert len(over.buckets) >= 3
    # with every gradient there, every bucket started during backward, not at reducer();
    # a parameter without one holds its bucket (and those after it) back to reducer()
    started = over.started_during_backward
    if variant == "unused":
        assert all(k < len(over.buckets) for k in started), started
    else:
        assert started == [len(over.buckets)] * 4, started
    assert got == want
    assert over.reducer.stats.calls == plain.reducer.stats.calls
    assert over.dense_reducer.stats.calls == plain.dense_reducer.stats.calls


def test_numpy_buckets_start_finish_equal_reduce():
    shapes = {"w1": (40, 30), "b1": (40,), "w2": (7, 40), "b2": (7,), "w3": (300,)}
    mk = lambda: GradientBuckets(shapes, hpccomm.Allreducer(COMM, codec="onebit",  # noqa: E731
                                                            algorithm="twoshot", op="mean"),
                                 bucket_bytes=2048, min_compress=100)
    a, b = mk(), mk()
    for step in range(3):
        g1 = {k: rank_data(int(np.prod(s)), seed=10 * step + i).reshape(s)
              for i, (k, s) in enumerate(shapes.items())}
        g2 = {k: v.copy() for k, v in g1.items()}
        a.reduce(g1)
        b.start(g2)
        b.finish()
        assert [digest(g1[k]) for k in shapes] == [digest(g2[k]) for k in shapes]
    assert same_on_all_ranks(g2["w1"])
    with pytest.raises(RuntimeError, match="before finish"):
        b.start(g2)
        b.start(g2)
    b.finish()
