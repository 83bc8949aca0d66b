"""``ebq`` on real MPI: every element of every allreduce result within the
bound stated in :mod:`hpccomm.codecs.ebq` of the exact sum, for every
algorithm that takes the codec, on random and adversarial inputs, with the
same bits on every rank; values out of the code range raised on every rank.

The exact sum is ``math.fsum`` of every rank's input, regenerated from the
seed on every rank.  The stated bounds (``u = 2**-24``, ``gamma_m = m u /
(1 - m u)``, ``ulp(r)`` the float32 spacing at the result):

* twoshot, allgather, summable, auto's compressed choices: ``P b + ulp(r) / 2``
* hierarchical (N nodes, the largest of L ranks): ``N b + gamma_(L-1)
  sum_p |x_p| + ulp(r) / 2``
* auto choosing dense: ``gamma_(P-1) sum_p |x_p|``

The comparison is evaluated in float64: a slack of ``2**-50 (|S| + |r|)``
covers the rounding of ``fsum``'s result and of the difference.
"""
import math

import numpy as np
import pytest

import hpccomm
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend
from hpccomm.kernels import ebq as K

from .helpers import COMM, RANK, SIZE, raise_everywhere, \
    same_on_all_ranks

pytestmark = pytest.mark.mpi

#: a step of 4 significant bits, 15 2**-13 (1e-3's is 2**-9, whose float32
#: sums are exact far longer): sums of large codes do round
BOUND = 9.4e-4
STEP = hpccomm.get_codec("ebq", bound=BOUND).step
N = 3001
U = 2.0 ** -24


def gamma(m):
    return m * U / (1 - m * U)


def inputs(kind, n, rank, terms=1):
    """Rank ``rank``'s input; ``terms``: how many inputs an encode may sum
    (hierarchical's node sums must stay in the code range)."""
    rng = np.random.default_rng([17, rank, n, len(kind)])
    if kind == "random":
        return (rng.standard_normal(n) * 300 * BOUND).astype(np.float32)
    if kind == "half-steps":    # just below a half step, the same on every rank: errors add up
        k = np.random.default_rng([18, n]).integers(-5000, 5000, n)
        return ((k + 0.5 - 1e-4) * STEP).astype(np.float32)
    if kind == "mixed":         # ties, zeros, subnormals, a wide spread of magnitudes
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 3, n)
        x[::7] = (rng.integers(-100, 100, x[::7].size) + 0.5) * STEP
        x[::11] = 0.0
        x[3::13] = 1e-40
        return x.astype(np.float32)
    # large codes: the summed codes pass 2**20 (decoded with one rounding)
    top = (K.QMAX - 2) / terms
    sign = np.random.default_rng([19, n]).choice([-1.0, 1.0], n)
    return (sign * rng.uniform(0.6 * top, top, n) * STEP).astype(np.float32)


def exact(kind, n, terms=1):
    xs = [inputs(kind, n, r, terms).astype(np.float64) for r in range(SIZE)]
    S = np.array([math.fsum(col) for col in zip(*xs)]) if n else np.zeros(0)
    return S, np.sum(np.abs(xs), axis=0)


def violations(r, S, allowed):
    r64 = r.astype(np.float64)
    slack = 2.0 ** -50 * (np.abs(S) + np.abs(r64))
    bad = np.abs(r64 - S) > allowed + slack
    return [(int(i), float(r[i]), float(S[i]), float(allowed[i])) for i in np.flatnonzero(bad)[:5]]


def half_ulp(r):
    return 0.5 * np.spacing(np.abs(r)).astype(np.float64)


def nodes_of(size):
    return [rank // 2 for rank in range(size)]   # nodes of 2 ranks (the last may have 1)


CASES = [("twoshot", {}), ("allgather", {}), ("summable", {}),
         ("hierarchical", {"nodes": "pairs"}),
         ("hierarchical", {"nodes": "pairs", "outer": "allgather"}),
         ("auto", {}), ("auto", {"policy": {"k": "twoshot"}}),
         ("auto", {"policy": {"k": "allgather"}})]


def options(algorithm, opts):
    opts = dict(opts)
    if opts.get("nodes") == "pairs":
        opts["nodes"] = nodes_of(SIZE)
    return opts


@pytest.mark.parametrize("kind", ["random", "half-steps", "mixed", "large"])
@pytest.mark.parametrize("algorithm,opts", CASES,
                         ids=[f"{a}-{'-'.join(map(str, o.values()))}" for a, o in CASES])
def test_every_element_within_the_stated_bound(algorithm, opts, kind):
    opts = options(algorithm, opts)
    hier = algorithm == "hierarchical"
    n = N if kind != "large" else 1000
    x = inputs(kind, n, RANK, terms=SIZE if hier else 1)
    reducer = hpccomm.Allreducer(COMM, codec="ebq", bound=BOUND, algorithm=algorithm, **opts)
    r = reducer(x, key="k")
    assert same_on_all_ranks(r)
    S, mag = exact(kind, n, terms=SIZE if hier else 1)
    if hier:
        nodes = opts["nodes"]
        L = max(nodes.count(h) for h in set(nodes))
        allowed = len(set(nodes)) * BOUND + gamma(L - 1) * mag + half_ulp(r)
    elif algorithm == "auto" and reducer.stats.last.extra.get("auto") == "dense":
        allowed = gamma(SIZE - 1) * mag
    else:
        allowed = SIZE * BOUND + half_ulp(r)
    bad = violations(r, S, allowed)
    assert not bad, (reducer.stats.last.extra, bad)
    if kind == "half-steps" and SIZE > 1 and not hier and "auto" not in reducer.stats.last.extra:
        # the errors really add up: the check is not vacuous
        assert np.max(np.abs(r.astype(np.float64) - S)) > 0.9 * SIZE * STEP / 2


def test_error_feedback_keeps_the_bound_on_the_compensated_vectors():
    """With error feedback: ``|r - sum_p (x_p + e_p)| <= P b + ulp(r) / 2``,
    ``e_p`` each rank's residual before the call (from ``state_dict``), and
    every residual within ``b``."""
    reducer = hpccomm.Allreducer(COMM, codec="ebq", bound=BOUND, algorithm="twoshot",
                                 error_feedback=True)
    e = np.zeros(N, np.float32)
    for step in range(3):
        x = inputs("random", N, RANK) * np.float32(step + 1)
        v = (x + e).astype(np.float64)
        r = reducer(x, key="g")
        vs = COMM.allgather(v)
        S = np.array([math.fsum(col) for col in zip(*vs)])
        assert not violations(r, S, SIZE * BOUND + half_ulp(r))
        assert same_on_all_ranks(r)
        res = reducer.state_dict()["keys"]["g"]["residuals"]
        e = res.get("worker", np.zeros(N, np.float32))
        assert all(np.all(np.abs(a) <= BOUND) for a in res.values())


@pytest.mark.parametrize("algorithm,ef", [("twoshot", False), ("twoshot", True),
                                          ("allgather", True), ("summable", False),
                                          ("hierarchical", False)])
def test_values_beyond_the_code_range_raise_on_every_rank(algorithm, ef):
    opts = {"nodes": nodes_of(SIZE)} if algorithm == "hierarchical" else {}
    reducer = hpccomm.Allreducer(COMM, codec="ebq", bound=BOUND, algorithm=algorithm,
                                 error_feedback=ef, **opts)
    x = inputs("random", 100, RANK)
    reducer(x, key="k")             # a first call: later ones may check after the encode
    bad = x.copy()
    if RANK == SIZE - 1:
        bad[42] = 1e4
    (name, message), agreed = raise_everywhere(lambda: reducer(bad, key="k"))
    assert name == "ValueError" and "beyond the code range" in message and agreed, message
    assert f"rank {SIZE - 1}" in message
    # the reducer goes on afterwards
    assert same_on_all_ranks(reducer(x, key="k"))


@pytest.mark.parametrize("gpu_aware", ["off", "on"])
def test_device_input_beyond_the_code_range_raises_on_every_rank(gpu_aware):
    """Device input (no device twin: the gradient is staged) is checked
    through a host copy before the agreement."""
    backend = HostDeviceBackend()
    hpccomm.register_device_backend(backend)
    try:
        reducer = hpccomm.Allreducer(COMM, codec="ebq", bound=BOUND, algorithm="twoshot",
                                     gpu_aware=gpu_aware)
        x = inputs("random", 100, RANK)
        got = reducer(HostDeviceArray(x.copy()), key="k")
        S, _ = exact("random", 100)
        assert not violations(got.host, S, SIZE * BOUND + half_ulp(got.host))
        bad = x.copy()
        if RANK == 0:
            bad[3] = -1e4
        (name, message), agreed = raise_everywhere(
            lambda: reducer(HostDeviceArray(bad), key="k"))
        assert name == "ValueError" and "beyond the code range" in message and agreed, message
    finally:
        hpccomm.unregister_device_backend(backend)


def test_sparse_algorithms_refuse_ebq():
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(8, np.float32), codec="ebq",
                                  algorithm="sparse_allgather"))
    assert name == "ValueError" and agreed, message
