"""Error-feedback memories (no MPI): double-buffered residuals, DGC's memory,
the choice of memory."""
import numpy as np
import pytest

from hpccomm.memory import DGCMemory, NoMemory, ResidualMemory, available_memories, get_memory
from hpccomm.state import KeyState


def test_compensate_update_and_buffer_reuse():
    fb, st = ResidualMemory(), KeyState()
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
    fb, st = ResidualMemory(), KeyState()
    g = np.arange(6, dtype=np.float32)
    fb.update(st, "worker", fb.compensate(st, "worker", g), np.zeros(6, np.float32))
    before = st.residuals["worker"].copy()
    fb.compensate(st, "worker", g)          # the encode after it raises: no update
    np.testing.assert_array_equal(st.residuals["worker"], before)
    assert st.state_dict()["residuals"]["worker"].tolist() == before.tolist()


def test_update_sparse_equals_dense_subtraction():
    fb, st = ResidualMemory(), KeyState()
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
    fb, st = NoMemory(), KeyState()
    g = np.ones(3, np.float32)
    assert fb.compensate(st, "worker", g) is g
    fb.update(st, "worker", g, g)
    fb.update_sparse(st, "worker", g, np.array([0]), np.ones(1, np.float32))
    assert not st.residuals


def test_get_memory_forms():
    assert available_memories() == ("dgc", "none", "residual")
    assert isinstance(get_memory(None, biased=True), ResidualMemory)
    assert isinstance(get_memory(None, biased=False), NoMemory)
    assert isinstance(get_memory(True), ResidualMemory) and isinstance(get_memory(False), NoMemory)
    assert isinstance(get_memory("dgc"), DGCMemory)
    mem = DGCMemory(momentum=0.5)
    assert get_memory(mem) is mem
    assert mem.describe() == "dgc(masking=True,momentum=0.5,nesterov=False)"
    assert get_memory(True).describe() == "True" and get_memory(False).describe() == "False"
    with pytest.raises(ValueError, match="unknown memory 'bogus'"):
        get_memory("bogus")
    with pytest.raises(TypeError, match="error_feedback must be"):
        get_memory(1.5)
    with pytest.raises(ValueError, match="momentum"):
        DGCMemory(momentum=1.0)


def dgc_reference(gs, sent_masks, m, nesterov):
    """DGC's worker side written out (the paper's Algorithm 2): per step, the
    vector that goes out and the memory after it."""
    u = np.zeros_like(gs[0])
    v = np.zeros_like(gs[0])
    outs = []
    for g, mask in zip(gs, sent_masks):
        if nesterov:
            u = (u + g) * m
            v = v + u + g
        else:
            u = u * m + g
            v = v + u
        outs.append(v.copy())
        v = np.where(mask, np.float32(0), v)
        u = np.where(mask, np.float32(0), u)
    return outs, u, v


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_dgc_memory_is_momentum_correction_and_masking(nesterov, sparse):
    rng = np.random.default_rng(3)
    n, m = 37, np.float32(0.9)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    masks = [rng.random(n) < 0.3 for _ in range(4)]
    want, want_u, want_e = dgc_reference(gs, masks, m, nesterov)
    mem, st = DGCMemory(momentum=0.9, nesterov=nesterov), KeyState()
    for g, mask, w in zip(gs, masks, want):
        v = mem.compensate(st, "worker", g)
        np.testing.assert_allclose(v, w, rtol=1e-6, atol=1e-6)
        idx = np.flatnonzero(mask).astype(np.int32)
        if sparse:
            mem.update_sparse(st, "worker", v, idx, v[idx].copy())
        else:
            decoded = np.where(mask, v, np.float32(0))
            mem.update(st, "worker", v, decoded)
    np.testing.assert_allclose(st.residuals["momentum"], want_u, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(st.residuals["worker"], want_e, rtol=1e-6, atol=1e-6)
    assert not st.residuals["worker"][masks[-1]].any()
    assert not st.residuals["momentum"][masks[-1]].any()


def test_dgc_memory_without_masking_keeps_the_velocity():
    mem, st = DGCMemory(momentum=0.5, masking=False), KeyState()
    g = np.ones(4, np.float32)
    v = mem.compensate(st, "worker", g)
    mem.update(st, "worker", v, v.copy())
    np.testing.assert_array_equal(st.residuals["momentum"], g)
    np.testing.assert_array_equal(st.residuals["worker"], np.zeros(4, np.float32))


def test_owner_slot_keeps_a_plain_residual():
    assert isinstance(DGCMemory().owner, ResidualMemory)
    assert isinstance(ResidualMemory().owner, ResidualMemory)
    assert isinstance(NoMemory().owner, NoMemory)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fresh_part_is_what_v_adds_to_the_residual(nesterov):
    """``fresh``: the part of ``v`` new this call, whose scale threshold's
    ``alpha`` follows -- ``g`` for the residual, DGC's velocity ``u``
    (Nesterov: ``u + g``) for DGC's memory."""
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 5)).astype(np.float32)
    st = KeyState()
    assert ResidualMemory().fresh(st, "worker", g) is g
    assert NoMemory().fresh(st, "worker", g) is g
    mem, st = DGCMemory(momentum=0.5, nesterov=nesterov), KeyState()
    for _ in range(2):
        v = mem.compensate(st, "worker", g)
        fresh = mem.fresh(st, "worker", g)
        u = st.residuals["momentum"].reshape(g.shape)
        assert fresh.shape == g.shape
        np.testing.assert_array_equal(fresh, u + g if nesterov else u)
        mem.update(st, "worker", v, np.zeros(15, np.float32))
