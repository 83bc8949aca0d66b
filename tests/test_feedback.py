"""Error-feedback bookkeeping (no MPI): double-buffered residuals."""
import numpy as np

from hpccomm.feedback import ErrorFeedback, KeyState


def test_compensate_update_and_buffer_reuse():
    fb, st = ErrorFeedback(True), KeyState()
    rng = np.random.default_rng(0)
    g = rng.standard_normal((4, 5)).astype(np.float32)
    v = fb.compensate(st, "worker", g)
    assert v.shape == g.shape and np.array_equal(v, g) and v is not g
    decoded = np.round(v)
    fb.update(st, "worker", v, decoded)
    e1 = st.residuals["worker"]
    np.testing.assert_array_equal(e1, (g - decoded).reshape(-1))
    g2 = rng.standard_normal((4, 5)).astype(np.float32)
    v2 = fb.compensate(st, "worker", g2)
    np.testing.assert_array_equal(v2, g2 + e1.reshape(4, 5))
    fb.update(st, "worker", v2, np.zeros(20, np.float32))
    # the two buffers alternate: no allocation after the first calls
    assert np.may_share_memory(st.spares["worker"], e1)
    np.testing.assert_array_equal(st.residuals["worker"], (g2 + (g - decoded)).reshape(-1))


def test_an_error_between_compensate_and_update_keeps_the_residual():
    fb, st = ErrorFeedback(True), KeyState()
    g = np.arange(6, dtype=np.float32)
    fb.update(st, "worker", fb.compensate(st, "worker", g), np.zeros(6, np.float32))
    before = st.residuals["worker"].copy()
    fb.compensate(st, "worker", g)          # the encode after it raises: no update
    np.testing.assert_array_equal(st.residuals["worker"], before)
    assert st.state_dict()["residuals"]["worker"].tolist() == before.tolist()


def test_update_sparse_equals_dense_subtraction():
    fb, st = ErrorFeedback(True), KeyState()
    rng = np.random.default_rng(1)
    g = rng.standard_normal(50).astype(np.float32)
    g[3] = -0.0
    v = fb.compensate(st, "worker", g)
    want = v - np.zeros(50, np.float32)
    idx = np.array([0, 3, 17, 49], dtype=np.int32)
    vals = v[idx] * np.float32(0.5)
    want[idx] = v[idx] - vals
    fb.update_sparse(st, "worker", v, idx, vals)
    assert st.residuals["worker"].view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_disabled_is_a_no_op():
    fb, st = ErrorFeedback(False), KeyState()
    g = np.ones(3, np.float32)
    assert fb.compensate(st, "worker", g) is g
    fb.update(st, "worker", g, g)
    fb.update_sparse(st, "worker", g, np.array([0]), np.ones(1, np.float32))
    assert not st.residuals
