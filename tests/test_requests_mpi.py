"""Non-blocking reductions (``Allreducer.start``): several requests in flight,
waited in any order, give the blocking call's bits; a different start order
on one rank is the same clear error everywhere; errors reach every rank's
``wait()``; blocking calls and state queue behind the requests."""
import numpy as np
import pytest

import hpccomm
from hpccomm import requests

from .helpers import (COMM, RANK, SIZE, digest, exact_sum, raise_everywhere, rank_data,
                      same_on_all_ranks)

# narrow: the non-blocking layer (Allreducer.start) above the collectives, which
# tests/test_collectives_mpi.py runs at every rank count
pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

CONFIGS = [("none", "mpi"), ("onebit", "twoshot"), ("topk", "allgather"), ("terngrad", "auto"),
           ("qsgd", "twoshot")]
SIZES = {"a": 1001, "b": 64, "c": 4099, "d": 1}


def run_blocking(codec, algorithm, check, steps):
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, check=check, op="mean")
    out = []
    for step in range(steps):
        for i, (key, n) in enumerate(SIZES.items()):
            out.append(digest(reducer(rank_data(n, seed=10 * step + i), key=key)))
    return out, reducer


@pytest.mark.parametrize("codec,algorithm", CONFIGS)
@pytest.mark.parametrize("check", ["always", "first"])
@pytest.mark.parametrize("order", ["started", "reversed", "shuffled"])
def test_requests_in_flight_equal_blocking_bits(codec, algorithm, check, order):
    steps = 3
    want, blocking = run_blocking(codec, algorithm, check, steps)
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, check=check, op="mean")
    got = []
    for step in range(steps):
        inputs = [rank_data(n, seed=10 * step + i) for i, n in enumerate(SIZES.values())]
        reqs = [reducer.start(x, key=key) for x, key in zip(inputs, SIZES)]
        # the same wait order on every rank is not required: each rank waits its own way
        waits = {"started": list(range(len(reqs))), "reversed": list(range(len(reqs)))[::-1],
                 "shuffled": list(np.random.default_rng([step, RANK]).permutation(len(reqs)))}
        results = [None] * len(reqs)
        for i in waits[order]:
            results[i] = reqs[i].wait()
        assert all(r.done and r.test() for r in reqs)
        got.extend(digest(r) for r in results)
    assert got == want
    assert reducer.stats.calls == blocking.stats.calls == steps * len(SIZES)
    assert reducer.stats.bytes_sent == blocking.stats.bytes_sent
    assert reducer.state_dict()["keys"]["a"]["step"] == steps


@pytest.mark.parametrize("out_mode", ["inplace", "separate"])
def test_started_call_writes_out(out_mode):
    x = rank_data(3001, seed=4)
    want = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")(x.copy(), key="g")
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    src = x.copy()
    out = src if out_mode == "inplace" else np.empty_like(src)
    got = reducer.start(src, key="g", out=out).wait()
    assert got is out and digest(out) == digest(want)


def test_blocking_call_queues_behind_started_ones():
    """A blocking call (of any reducer) while requests are in flight runs
    after them, so the steps and residuals follow the program's order."""
    a = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    b = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi")
    ref_a = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    xs = [rank_data(2048, seed=s) for s in range(4)]
    want = [digest(ref_a(x, key="k")) for x in xs]
    reqs = [a.start(x, key="k") for x in xs[:3]]
    dense = b(xs[0], key="dense")          # a different reducer, blocking, queued behind
    last = a(xs[3], key="k")               # the same key: its fourth step, after the three
    got = [digest(r.wait()) for r in reqs] + [digest(last)]
    assert got == want
    assert digest(dense) == digest(hpccomm.allreduce(xs[0]))
    assert a.state_dict()["keys"]["k"]["step"] == 4 and requests.pending() == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["always", "first"])
def test_different_start_order_is_the_same_error_everywhere(check):
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot", check=check)
    x, y = rank_data(500, seed=1), rank_data(500, seed=2)
    for _ in range(2):  # known keys: under check="first" only the start check sees the order
        reducer.start(x, key="x").wait()
        reducer.start(y, key="y").wait()
    order = [("y", y), ("x", x)] if RANK == SIZE - 1 else [("x", x), ("y", y)]
    reqs = [reducer.start(v, key=k) for k, v in order]
    (name, message), same = raise_everywhere(lambda: reqs[0].wait(timeout=60))
    assert same and name == "ConsistencyError", message
    assert "key='x'" in message and "key='y'" in message
    (name2, message2), same2 = raise_everywhere(lambda: reqs[1].wait(timeout=60))
    assert same2 and name2 == "ConsistencyError", message2
    # the reducer goes on working after the errors
    assert same_on_all_ranks(reducer.start(x, key="z").wait())


@pytest.mark.mpi(min_size=2)
def test_error_of_a_started_call_is_raised_by_every_wait():
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    good = rank_data(777)
    bad = good.copy()
    if RANK == 0:
        bad[3] = np.inf
    r1, r2, r3 = (reducer.start(good, key="a"), reducer.start(bad, key="b"),
                  reducer.start(good, key="c"))
    (name, message), same = raise_everywhere(lambda: r2.wait(timeout=60))
    assert same and name == "NonFiniteError", message
    want = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")(good, key="a")
    assert digest(r1.wait()) == digest(want) == digest(r3.wait())


def test_done_callback_and_timeout():
    reducer = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi")
    seen = []
    req = reducer.start(rank_data(10), key="cb")
    req.add_done_callback(lambda r: seen.append(r.key))
    req.wait()
    req.add_done_callback(lambda r: seen.append("again"))  # already done: called at once
    assert seen == ["cb", "again"]
    with pytest.raises(TimeoutError):
        hpccomm.requests.Request("never").wait(timeout=0.01)


@pytest.mark.parametrize("codec,algorithm", CONFIGS + [("bf16", "twoshot"), ("topk", "twoshot")])
def test_waiting_with_sleeps_gives_the_same_bits(codec, algorithm):
    """HPCCOMM_PROGRESS_SLEEP_US's way of waiting (non-blocking calls, tested
    between sleeps) on every pattern the algorithms use."""
    from hpccomm.collectives.transport import set_wait_interval

    xs = [rank_data(n, seed=n) for n in (1, 1000, 70001)]
    want = [digest(hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm)(x, key="k"))
            for x in xs]
    set_wait_interval(5e-5)
    try:
        got = [digest(hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm)(x, key="k"))
               for x in xs]
    finally:
        set_wait_interval(None)
    assert got == want


@pytest.mark.mpi(min_size=2)
def test_a_blocking_call_while_only_some_ranks_still_have_started_calls():
    """Rank 0 has waited for its started call, the others have not: a new
    reducer's blocking call must make the same MPI calls on every rank
    (queueing it behind the pending calls on some ranks only, and running it
    at once on the others, put their agreements on different communicators)."""
    started = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    req = started.start(rank_data(1 << 18), key="s")
    if RANK == 0:
        req.wait()
    fresh = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi")
    got = fresh(rank_data(100, integers=True))
    np.testing.assert_array_equal(got, exact_sum(100, integers=True).astype(np.float32))
    assert same_on_all_ranks(req.wait())
