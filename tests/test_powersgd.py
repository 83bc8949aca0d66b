"""PowerSGD without MPI: the low-rank kernels against numpy, Gram-Schmidt,
the compression rule against PyTorch's, options and layouts."""
import numpy as np
import pytest

import hpccomm
from hpccomm.kernels import lowrank as K
from hpccomm.kernels.rng import stream_key, uniform_array
from hpccomm.layout import check_layout

SHAPES = [(1, 1), (1, 9), (9, 1), (7, 13), (64, 33), (3, 300), (300, 5)]


def rand(shape, seed=0):
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def close_to_f64(got, want64):
    """float64 products rounded once: within a float32 ulp of the float64
    value (the kernels sum in another order, so a tie may tip)."""
    tol = np.spacing(np.abs(want64).astype(np.float32)) + 1e-30
    return np.all(np.abs(got.astype(np.float64) - want64) <= tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [1, 3])
def test_products_match_numpy_float64(shape, r):
    n, m = shape
    M, Q, P = rand((n, m)), rand((m, r), 1), rand((n, r), 2)
    got = np.empty((n, r), np.float32)
    K.project(M, Q, got)
    assert close_to_f64(got, M.astype(np.float64) @ Q.astype(np.float64))
    got = np.empty((m, r), np.float32)
    K.back_project(M, P, got)
    assert close_to_f64(got, M.T.astype(np.float64) @ P.astype(np.float64))
    Q2 = rand((m, r), 3)
    out, out2 = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    K.expand(P, Q, out)
    assert close_to_f64(out, P.astype(np.float64) @ Q.T.astype(np.float64))
    pair1, pair2 = np.empty_like(out), np.empty_like(out)
    K.expand_pair(P, Q, Q2, pair1, pair2)
    K.expand(P, Q2, out2)
    assert np.array_equal(pair1, out) and np.array_equal(pair2, out2)


def test_products_do_not_depend_on_how_the_work_is_cut():
    """Rows of P and columns of Q (what the threads split) come out the same
    computed from a slice: the sums run in an order of the data alone."""
    M, Q, P = rand((50, 700)), rand((700, 2), 1), rand((50, 2), 2)
    whole, part = np.empty((50, 2), np.float32), np.empty((20, 2), np.float32)
    K.project(M, Q, whole)
    K.project(np.ascontiguousarray(M[10:30]), Q, part)
    assert np.array_equal(whole[10:30], part)
    whole, part = np.empty((700, 2), np.float32), np.empty((300, 2), np.float32)
    K.back_project(M, P, whole)
    K.back_project(np.ascontiguousarray(M[:, 100:400]), P, part)
    assert np.array_equal(whole[100:400], part)


def mgs(A, eps=0.0):
    """Modified Gram-Schmidt in float64 (PyTorch's, with zero columns kept zero)."""
    W = A.astype(np.float64).copy()
    for c in range(W.shape[1]):
        norm = np.sqrt(np.sum(W[:, c] ** 2)) + eps
        W[:, c] = 0.0 if norm == 0 else W[:, c] / norm
        for d in range(c + 1, W.shape[1]):
            W[:, d] -= np.dot(W[:, c], W[:, d]) * W[:, c]
    return W


@pytest.mark.parametrize("k,r", [(1, 1), (5, 3), (100, 4), (257, 8)])
def test_orthogonalize_is_gram_schmidt(k, r):
    A = rand((k, r), 4)
    want = mgs(A)
    zero = K.orthogonalize(A, 0.0)
    assert zero == 0
    np.testing.assert_allclose(A, want, rtol=0, atol=1e-6)
    if k >= r:
        np.testing.assert_allclose(A.T.astype(np.float64) @ A, np.eye(r), atol=1e-6)


def test_orthogonalize_zero_and_dependent_columns_and_epsilon():
    A = rand((20, 3), 5)
    A[:, 1] = 0.0
    assert K.orthogonalize(A, 0.0) == 1
    assert np.all(np.isfinite(A)) and not A[:, 1].any()
    B = rand((20, 2), 6)
    C = B.copy()
    K.orthogonalize(C, 1.0)     # the norm plus one: shorter than a unit vector
    np.testing.assert_allclose(C, mgs(B, 1.0), atol=1e-6)
    assert np.linalg.norm(C[:, 0]) < 1.0


def test_fill_uniform_is_the_shared_counter_stream():
    key = stream_key(3, 0, 7, 14)
    out = np.empty((5, 3), np.float32)
    K.fill_uniform(key, out)
    want = 2.0 * uniform_array(key, 0, 15) - 1.0
    assert np.array_equal(out.reshape(-1), want.astype(np.float32))
    assert np.all((out >= -1) & (out < 1))


def torch_should_compress():
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    return hook._should_compress


@pytest.mark.parametrize("rank,rate", [(1, 2.0), (2, 2.0), (4, 1.0), (8, 3.5)])
def test_plan_follows_pytorchs_rule(rank, rate):
    """Which matrices are compressed, at which rank, and the floats sent:
    PyTorch's ``_should_compress`` on ``view(shape[0], -1)`` with the rank
    clipped to the matrix, and its count of elements after compression."""
    should = torch_should_compress()
    codec = hpccomm.get_codec("powersgd", rank=rank, min_compression_rate=rate)
    shapes = [(1, 1), (2, 2), (3, 7), (8, 64), (64, 8), (16, 3, 3, 3), (100, 100), (5,), (),
              (1, 500), (500, 1), (0, 4), (12, 12)]
    plan = codec.plan(shapes)
    want_floats = 0
    for shape, layer in zip(shapes, plan):
        if len(shape) < 2 or 0 in shape:
            assert layer.rank == 0
            want_floats += int(np.prod(shape))
            continue
        n = shape[0]
        m = int(np.prod(shape)) // n
        r = min(n, m, rank)
        compress, before, after = should(n, m, r, rate)
        assert (layer.rank > 0) == compress, shape
        assert (layer.rows, layer.cols) == (n, m)
        want_floats += after if compress else before
        if compress:
            assert layer.rank == r
    assert codec.wire_floats(shapes) == want_floats


@pytest.mark.parametrize("bad,msg", [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"rank": 1.5}, "rank must be a positive integer"),
    ({"rank": True}, "rank must be a positive integer"),
    ({"warm_start": 1}, "warm_start must be a bool"),
    ({"start_iter": -1}, "start_iter must be an integer >= 0"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate must be a finite"),
    ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon must be a finite"),
    ({"nonfinite": "propagate"}, "nonfinite must be 'raise'"),
])
def test_options_are_checked(bad, msg):
    with pytest.raises(ValueError, match=msg):
        hpccomm.get_codec("powersgd", **bad)


def test_it_has_no_packets():
    codec = hpccomm.get_codec("powersgd")
    assert codec.algorithm == "powersgd"
    with pytest.raises(TypeError, match="powersgd has no packets"):
        codec.encode(np.zeros(4, np.float32))


@pytest.mark.parametrize("layout,n,err,msg", [
    ([(2, 3), (4,)], 11, ValueError, "holds 10 elements, the tensor has 11"),
    ([(2, -3)], 6, ValueError, "negative"),
    ("ab", 2, TypeError, "sequence of shapes"),
    ([("a",)], 1, TypeError, "layout entries are shapes"),
])
def test_layout_is_checked(layout, n, err, msg):
    with pytest.raises(err, match=msg):
        check_layout(layout, n)


def test_layout_accepts_ints_and_empty_shapes():
    assert check_layout([(2, 3), 4, ()], 11) == ((2, 3), (4,), ())
