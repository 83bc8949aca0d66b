"""Bounded staleness (``staleness=s``): step ``t`` delivers the reduced
gradient of step ``t - s``, equal bit for bit to what the synchronous path
gives at step ``t - s`` (error feedback included), the same on every rank;
nothing (zeros, ``delivered`` False) in the first ``s`` steps; its state
survives a checkpoint."""
import time

import numpy as np
import pytest

import hpccomm
from hpccomm.fusion import GradientBuckets

from .helpers import COMM, RANK, digest, rank_data, same_on_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

SHAPES = {"w1": (40, 30), "b1": (40,), "w2": (7, 40), "b2": (7,), "w3": (300,)}
STEPS = 6


def step_grads(step):
    """Rank- and step-dependent gradients (the same whatever the staleness)."""
    return {k: rank_data(int(np.prod(s)), seed=10 * step + i).reshape(s)
            for i, (k, s) in enumerate(SHAPES.items())}


def numpy_buckets(codec, algorithm, staleness):
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, op="mean", seed=3)
    return GradientBuckets(SHAPES, reducer, bucket_bytes=2048, min_compress=100,
                           staleness=staleness)


def digests(grads):
    return [digest(grads[k]) for k in SHAPES]


@pytest.mark.parametrize("codec,algorithm", [("onebit", "twoshot"), ("topk", "allgather"),
                                             ("none", "mpi")])
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_numpy_delivers_the_synchronous_result_of_s_steps_ago(codec, algorithm, staleness):
    sync = numpy_buckets(codec, algorithm, 0)
    want = []
    for step in range(STEPS):
        g = step_grads(step)
        assert sync.reduce(g) is True
        want.append(digests(g))
    stale = numpy_buckets(codec, algorithm, staleness)
    assert stale.slots == staleness + 1
    for step in range(STEPS):
        g = step_grads(step)
        delivered = stale.reduce(g)
        assert delivered is stale.delivered
        if step < staleness:
            assert not delivered and all(not v.any() for v in g.values())
        else:
            assert delivered and digests(g) == want[step - staleness], step
        assert same_on_all_ranks(g["w1"]) and same_on_all_ranks(g["w3"])
    assert stale.in_flight == staleness
    assert stale.discard_in_flight() == staleness and stale.in_flight == 0
    assert stale.reducer.stats.calls == sync.reducer.stats.calls


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("staleness", [0, 1])
def test_numpy_start_returns_before_the_reduction_completes(staleness):
    """``start`` only starts: rank 0 returns from it (and says so) while rank 1
    has not joined the reduction yet."""
    from mpi4py import MPI

    b = numpy_buckets("onebit", "twoshot", staleness)
    b.reduce(step_grads(0))                # the reducers' communicators exist
    arrived = True
    if RANK == 0:
        b.start(step_grads(1))
        COMM.send("started", dest=1, tag=77)
    elif RANK == 1:
        deadline = time.monotonic() + 10
        while not COMM.Iprobe(source=0, tag=77) and time.monotonic() < deadline:
            time.sleep(0.01)
        arrived = COMM.Iprobe(source=0, tag=77)
        b.start(step_grads(1))
        if arrived:
            COMM.recv(source=0, tag=77)
    else:
        b.start(step_grads(1))
    b.finish()
    assert COMM.allreduce(arrived, op=MPI.LAND), "start() waited for the reduction"
    if RANK == 1 and not arrived:
        COMM.recv(source=0, tag=77)


def test_numpy_state_dict_carries_the_steps_in_flight():
    want = []
    whole = numpy_buckets("onebit", "twoshot", 2)
    for step in range(STEPS):
        g = step_grads(step)
        whole.reduce(g)
        want.append(digests(g))
    first = numpy_buckets("onebit", "twoshot", 2)
    for step in range(3):
        first.reduce(step_grads(step))
    state = first.state_dict()
    assert len(state["pending"]) == 2 and state["steps"] == 3
    resumed = numpy_buckets("onebit", "twoshot", 2)
    resumed.load_state_dict(state)
    for step in range(3, STEPS):
        g = step_grads(step)
        assert resumed.reduce(g)
        assert digests(g) == want[step], step
    with pytest.raises(ValueError, match="staleness=2"):
        numpy_buckets("onebit", "twoshot", 1).load_state_dict(state)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_staleness_is_refused(bad):
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        numpy_buckets("none", "mpi", bad)


def torch_steps(staleness, overlap, codec="onebit", algorithm="twoshot", steps=STEPS,
                state=None, start=0):
    """Backward on fixed weights (no optimizer: every step's local gradient is
    the same whatever the staleness); returns each step's ``.grad`` digests
    after ``reducer()`` and the reducer."""
    torch = pytest.importorskip("torch")
    from hpccomm.torch_grads import GradReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    reducer = GradReducer(model, COMM, codec=codec, algorithm=algorithm, op="mean", seed=3,
                          min_compress=200, bucket_bytes=4096, overlap=overlap,
                          staleness=staleness)
    if state is not None:
        reducer.load_state_dict(state)
    out = []
    for step in range(start, steps):
        model.zero_grad(set_to_none=False)
        x = torch.from_numpy(np.random.default_rng([7, RANK, step]).standard_normal(
            (16, 24)).astype(np.float32))
        model(x).square().mean().backward()
        assert reducer() == 0          # no copies: the views moved, not the data
        out.append((reducer.delivered,
                    [digest(p.grad.numpy()) for p in model.parameters()]))
        assert same_on_all_ranks(next(model.parameters()).grad.numpy())
    return out, reducer


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("staleness", [1, 2])
def test_torch_delivers_the_synchronous_result_of_s_steps_ago(staleness, overlap):
    want, _ = torch_steps(0, overlap)
    got, reducer = torch_steps(staleness, overlap)
    zero = [digest(np.zeros(shape, np.float32)) for shape in reducer.shapes.values()]
    for step, (delivered, grads) in enumerate(got):
        if step < staleness:
            assert not delivered and grads == zero
        else:
            assert delivered and grads == want[step - staleness][1], step
    # resuming from a checkpoint delivers what the uninterrupted run does
    _, first = torch_steps(staleness, overlap, steps=3)
    resumed, _ = torch_steps(staleness, overlap, state=first.state_dict(), start=3)
    assert resumed == got[3:]


def test_stale_training_keeps_ranks_in_lockstep():
    """SGD on delayed gradients: the weights stay bit-identical on every rank."""
    torch = pytest.importorskip("torch")
    from hpccomm.torch_grads import GradReducer

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))
    reducer = GradReducer(model, COMM, codec="terngrad", algorithm="twoshot", min_compress=200,
                          overlap=True, staleness=2, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng([11, RANK])
    applied = 0
    for _ in range(8):
        opt.zero_grad(set_to_none=False)
        x = torch.from_numpy(rng.standard_normal((16, 24)).astype(np.float32))
        model(x).square().mean().backward()
        reducer()
        if reducer.delivered:
            opt.step()
            applied += 1
    assert applied == 6
    for p in model.parameters():
        assert same_on_all_ranks(p.detach().numpy())
