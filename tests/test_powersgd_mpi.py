"""PowerSGD on real MPI: the same bits on every rank, a float64 numpy
oracle of the paper's steps call after call (error feedback, warm start),
the ranks' shares adding up to the result, the dense warm-up, the wire
volume, layouts from the fusion buckets, state save/restore and errors
raised on every rank."""
import numpy as np
import pytest

import hpccomm
from hpccomm.errors import ConsistencyError
from hpccomm.fusion import GradientBuckets
from hpccomm.kernels.rng import stream_key, uniform_array

from .helpers import COMM, RANK, SIZE, raise_everywhere, rank_data, same_on_all_ranks
from .test_powersgd import mgs

pytestmark = pytest.mark.mpi

#: matrices (compressed at rank <= 4), a 4-D tensor, a bias, a matrix too
#: small to compress (dense by the rule) and a scalar
LAYOUT = [(48, 20), (20,), (16, 3, 2, 2), (3, 3), (), (24, 40)]
N = sum(int(np.prod(s)) for s in LAYOUT)
CODEC_ID = 14


def oracle(inputs, layout, rank, warm_start=True, feedback=True, start_iter=0, seed=0):
    """The paper's steps in float64 numpy for every rank's inputs (a list of
    steps, each a list of per-rank flat float32 arrays): the sums each call
    must return, written from the algorithm's description (not the code)."""
    P = len(inputs[0])
    errors = [np.zeros(N, np.float32) for _ in range(P)]
    shapes = []
    for shape in layout:
        size = int(np.prod(shape)) if shape else 1
        n = shape[0] if len(shape) >= 2 else size
        m = size // n if len(shape) >= 2 and size else 1
        r = min(rank, n, m) if len(shape) >= 2 else 0
        shapes.append((size, n, m, r if r and (n + m) * r * 2 < n * m else 0))
    nq = sum(m * r for _, _, m, r in shapes)
    memory_q = None
    results = []
    for t, xs in enumerate(inputs):
        vs = [x + e for x, e in zip(xs, errors)] if feedback else list(xs)
        out = np.zeros(N)
        shares = [v.astype(np.float64).copy() for v in vs]
        if t >= start_iter and any(r for *_, r in shapes):
            if memory_q is None or not warm_start:
                q_all = 2.0 * uniform_array(stream_key(seed, 0, t, CODEC_ID), 0, nq) - 1.0
            else:
                q_all = memory_q
            new_q, qo, off = np.zeros(nq), 0, 0
            for size, n, m, r in shapes:
                if r:
                    Ms = [v[off:off + size].astype(np.float64).reshape(n, m) for v in vs]
                    Q = mgs(q_all[qo:qo + m * r].reshape(m, r))
                    Ph = mgs(sum(M @ Q for M in Ms))
                    Qw = [M.T @ Ph for M in Ms]
                    Qs = sum(Qw)
                    out[off:off + size] = (Ph @ Qs.T).reshape(-1)
                    for w in range(P):
                        shares[w][off:off + size] = (Ph @ Qw[w].T).reshape(-1)
                    new_q[qo:qo + m * r] = Qs.reshape(-1)
                    qo += m * r
                else:
                    out[off:off + size] = sum(v[off:off + size].astype(np.float64) for v in vs)
                off += size
            memory_q = new_q
        else:
            out = sum(v.astype(np.float64) for v in vs)
        if feedback:
            errors = [(v - s).astype(np.float32) for v, s in zip(vs, shares)]
        results.append(out)
    return results


def run(steps=3, layout=LAYOUT, seed=0, **options):
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", seed=seed, **options)
    got, inputs = [], []
    for t in range(steps):
        x = rank_data(N, seed=10 + t)
        got.append(reducer(x, key="k", layout=layout))
        inputs.append(COMM.allgather(x))
    return reducer, got, inputs


@pytest.mark.parametrize("rank,warm_start,feedback", [
    (1, True, True), (2, True, True), (4, False, True), (2, True, False)])
def test_matches_the_numpy_oracle_on_every_rank(rank, warm_start, feedback):
    reducer, got, inputs = run(rank=rank, warm_start=warm_start, error_feedback=feedback)
    same = [same_on_all_ranks(g) for g in got]
    want = oracle(inputs, LAYOUT, rank, warm_start, feedback)
    errs = [float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want)]
    assert all(same), same
    assert max(errs) < 1e-4, errs
    # (16, 12) at rank 4: (16 + 12) 4 * 2 >= 16 * 12, sent dense
    want_plan = "2 matrices, 4 dense" if rank == 4 else "3 matrices, 3 dense"
    assert reducer.stats.last.extra["powersgd"] == want_plan


def test_the_ranks_shares_add_up_to_the_result():
    """With error feedback each rank keeps ``e = v - share``; the shares sum
    to what the call returned (first call: ``v = x``)."""
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", rank=2)
    x = rank_data(N, seed=3)
    out = reducer(x, key="k", layout=LAYOUT)
    e = reducer.state_dict()["keys"]["k"]["residuals"]["worker"]
    shares = COMM.allgather((x.astype(np.float64) - e))
    total = sum(shares)
    assert np.linalg.norm(out - total) <= 1e-5 * np.linalg.norm(total)
    # the dense tensors are sent whole: no residual there
    assert not e[48 * 20:48 * 20 + 20].any()


def test_start_iter_calls_are_plain_mpi_allreduce():
    dense = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi")
    reducer, got, _ = run(steps=3, start_iter=2, rank=2)
    for t in range(2):
        assert np.array_equal(got[t], dense(rank_data(N, seed=10 + t))), t
    assert reducer.stats.calls == 3
    assert "matrices" in reducer.stats.last.extra["powersgd"]
    assert reducer.state_dict()["keys"]["k"]["residuals"]["worker"][:10].any()


def test_wire_floats_are_r_times_n_plus_m_plus_the_dense_elements():
    for rank in (1, 3):
        reducer, _, _ = run(steps=1, rank=rank)
        # (48, 20), (16, 12), (24, 40) compressed; (20,), (3, 3), () dense
        want = rank * (48 + 20) + rank * (16 + 12) + rank * (24 + 40) + 20 + 9 + 1
        assert reducer.stats.last.extra["wire_floats"] == want


def test_one_tensor_uses_its_own_shape_and_a_vector_goes_dense():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", rank=1)
    m = rank_data(600, seed=4).reshape(20, 30)
    out = reducer(m, key="m")
    assert out.shape == (20, 30) and same_on_all_ranks(out)
    assert reducer.stats.last.extra["wire_floats"] == 50
    v = rank_data(600, seed=4)
    assert np.array_equal(reducer(v, key="v"),
                          hpccomm.Allreducer(COMM, codec="none")(v))
    assert reducer.stats.last.extra["powersgd"] == "no matrix"


def test_zero_matrices_give_zeros_not_nan():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", rank=3)
    out = reducer(np.zeros(N, np.float32), key="z", layout=LAYOUT)
    assert not out.any()


def test_fusion_buckets_hand_over_their_layout():
    shapes = {"w1": (32, 16), "b1": (32,), "w2": (10, 32), "b2": (10,)}
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", rank=1, op="mean")
    buckets = GradientBuckets(shapes, reducer, min_compress=0, compress_1d=True)
    grads = {k: rank_data(int(np.prod(s)), seed=6).reshape(s) for k, s in shapes.items()}
    buckets.reduce(grads)
    assert reducer.stats.last.extra["powersgd"] == "2 matrices, 2 dense"
    assert reducer.stats.last.extra["wire_floats"] == (32 + 16) + (10 + 32) + 32 + 10
    assert all(same_on_all_ranks(g) for g in grads.values())


def test_state_dict_resumes_with_the_same_bits():
    reducer, got, _ = run(steps=3, rank=2)
    first = hpccomm.Allreducer(COMM, codec="powersgd", rank=2)
    for t in range(2):
        first(rank_data(N, seed=10 + t), key="k", layout=LAYOUT)
    saved = first.state_dict()
    assert "powersgd:q" in saved["keys"]["k"]["residuals"]
    second = hpccomm.Allreducer(COMM, codec="powersgd", rank=2)
    second.load_state_dict(saved)
    assert np.array_equal(second(rank_data(N, seed=12), key="k", layout=LAYOUT), got[2])


def test_a_wrong_layout_on_one_rank_raises_everywhere():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd")
    layout = LAYOUT if RANK != SIZE - 1 else LAYOUT[:-1]
    got, agreed = raise_everywhere(lambda: reducer(rank_data(N), key="k", layout=layout))
    assert agreed and got[0] == "ValueError" and "holds" in got[1], got


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_different_layouts_raise_everywhere():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd")
    layout = [(N,)] if RANK == 0 else [(N // 2, 2)] if N % 2 == 0 else [(1, N)]
    got, agreed = raise_everywhere(lambda: reducer(rank_data(N), key="k", layout=layout))
    assert agreed and got[0] == ConsistencyError.__name__, got


def test_another_algorithm_is_refused_everywhere():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd", algorithm="twoshot")
    got, agreed = raise_everywhere(lambda: reducer(rank_data(N), key="k"))
    assert agreed and got[0] == "ValueError" and "reduced by algorithm 'powersgd'" in got[1]


def test_nan_on_one_rank_raises_everywhere():
    reducer = hpccomm.Allreducer(COMM, codec="powersgd")
    x = rank_data(N)
    if RANK == SIZE - 1:
        x[5] = np.nan
    got, agreed = raise_everywhere(lambda: reducer(x, key="k", layout=LAYOUT))
    assert agreed and got[0] == "NonFiniteError", got
