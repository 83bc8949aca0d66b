"""meProp in the training harness (hpccomm.bench.meprop): the kept entries
against a numpy top-k, the weight gradient's zero rows, K = width bit for bit,
and the option's validation (no MPI)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpccomm.bench import meprop  # noqa: E402
from hpccomm.bench.models import torch_model  # noqa: E402


def reference_topk(g: np.ndarray, k: int) -> np.ndarray:
    """Per row of the last axis: the k entries largest in magnitude, ties to
    the lower index; everything else zero."""
    order = np.argsort(-np.abs(g), axis=-1, kind="stable")[..., :k]
    keep = np.zeros(g.shape, dtype=bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return np.where(keep, g, np.float32(0))


def _backward_through(g: np.ndarray, k: int) -> np.ndarray:
    x = torch.zeros(g.shape, requires_grad=True)
    meprop.sparsify_backward(x, k).backward(torch.from_numpy(g))
    return x.grad.numpy()


# awkward sizes: a single unit, widths that are not powers of two, rows of
# one, several leading axes (tokens), k = 1 and k = width - 1
@pytest.mark.parametrize("shape,k", [((1, 1), 1), ((3, 7), 3), ((1, 513), 1), ((5, 13), 12),
                                     ((2, 3, 97), 10), ((4, 2, 5, 31), 30), ((33, 100), 50)])
def test_kept_entries_match_numpy_topk(shape, k):
    rng = np.random.default_rng(list(shape) + [k])
    g = rng.standard_normal(shape).astype(np.float32)
    assert np.array_equal(_backward_through(g, k), reference_topk(g, k))


@pytest.mark.parametrize("shape,k", [((6, 9), 4), ((3, 4, 11), 5), ((2, 64), 7)])
def test_ties_go_to_the_lower_index_and_sign_does_not_count(shape, k):
    # small integers of both signs: many equal magnitudes, +v and -v among them
    rng = np.random.default_rng(k)
    g = rng.integers(-3, 4, size=shape).astype(np.float32)
    got = _backward_through(g, k)
    assert np.array_equal(got, reference_topk(g, k))
    assert np.array_equal(got, _backward_through(g, k))       # deterministic
    assert (np.count_nonzero(got, axis=-1) <= k).all()


def test_weight_gradient_zero_rows_are_the_units_never_kept():
    torch.manual_seed(1)
    layer = torch.nn.Linear(23, 57)
    layer.meprop_layers = [""]          # the module itself: named_modules() names it ""
    meprop.attach(layer, 5)
    x = torch.randn(9, 23)
    upstream = torch.randn(9, 57)       # the gradient arriving at the layer's output
    (layer(x) * upstream).sum().backward()
    kept = reference_topk(upstream.numpy(), 5) != 0
    never = ~kept.any(axis=0)
    assert never.sum() > 0 and (~never).sum() > 5          # both kinds of rows occur
    w, b = layer.weight.grad.numpy(), layer.bias.grad.numpy()
    assert np.array_equal(~w.any(axis=1), never)
    assert np.array_equal(b == 0, never)
    sparse = torch.from_numpy(reference_topk(upstream.numpy(), 5))
    assert torch.allclose(layer.weight.grad, sparse.T @ x, atol=1e-5)


@pytest.mark.parametrize("model,x", [("cnn", lambda: torch.randn(6, 40)),
                                     ("charlm", lambda: torch.randint(0, 128, (2, 16)))])
def test_k_equal_to_the_width_is_the_unmodified_gradient_bit_for_bit(model, x):
    torch.manual_seed(2)
    inputs = x()

    def grads(k):
        net = torch_model(model, 3)
        if k:
            meprop.attach(net, k)
        net(inputs).square().mean().backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    plain = grads(0)
    width = min(meprop.layer_widths(torch_model(model, 3)).values())
    full = grads(width)
    assert all(torch.equal(plain[n], full[n]) for n in plain)
    fewer = grads(width // 8)
    assert not all(torch.equal(plain[n], fewer[n]) for n in plain)


def test_validation():
    meprop.validate("cnn", 0)
    meprop.validate("cnn", 512)
    meprop.validate("charlm", 384)
    for model, k, match in [("cnn", 513, "512"), ("charlm", 385, "384"), ("cnn", -1, "positive"),
                            ("mlp", 4, "torch model")]:
        with pytest.raises(SystemExit, match=match):
            meprop.validate(model, k)
    with pytest.raises(ValueError, match="1, 512"):
        meprop.attach(torch_model("cnn", 0), 600)


def test_lrgrid_refuses_meprop(capsys):
    # its table is keyed by codec: a meProp run's rate would replace fp32's
    from hpccomm.bench import lrgrid

    with pytest.raises(SystemExit):
        lrgrid.main(["--model", "cnn", "--meprop", "8"])
    assert "--meprop" in capsys.readouterr().err
