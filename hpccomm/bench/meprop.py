"""meProp (Sun et al., ICML 2017, "meProp: Sparsified Back Propagation for
Accelerated Deep Learning with Reduced Overfitting"; reference code
``lancopku/meProp``) for the training harness's torch models
(``train --model cnn|charlm --meprop K``).

In back-propagation, per example and per layer, only the ``K`` entries of a
hidden linear layer's output gradient largest in magnitude are kept; the rest
are set to zero and the sparse gradient is propagated on.  The weight
gradient ``dW = delta_sparse^T x`` then has non-zero rows (torch stores
``W`` as ``out x in``) only for the units kept by some example of the batch,
and the bias gradient non-zero entries only there.  The forward pass is
unchanged.  For data-parallel training the rows that are zero on *every*
rank are rows an exact sparse allreduce need not send.

Where it applies (each model's ``meprop_layers``, :mod:`hpccomm.bench.models`):

* the paper and its reference code apply meProp to the hidden layers' linear
  transforms and leave the output layer dense (``lancopku/meProp``'s MLP
  builds its last ``Linear`` with ``k = 0``); the 1-D CNN has one hidden
  fully connected layer, ``fc1`` (512 units, 96 % of its gradient), so it is
  ``fc1``; the convolutions and ``fc2`` (the output layer) stay dense;
* the character transformer: each block's feed-forward hidden layer,
  ``blocks.<i>.linear1`` (384 units) -- the transformer's counterpart of the
  paper's MLP hidden layer.  The attention projections are computed inside
  torch's fused multi-head attention function (no module output to act on),
  ``linear2`` writes into the residual stream and ``head`` is the output
  layer; they stay dense.

The selection acts on the gradient of the linear layer's *output*, before the
activation's derivative, as the reference code's ``Linear`` (followed by a
separate ReLU) does.  "Per example" is per row of the last axis: per sample
for the CNN's ``[batch, 512]``, per token for the transformer's
``[batch, time, 384]``.  Ties in magnitude go to the lower unit index (a
stable sort), so the kept set is the same on every run and machine.  One
difference from the reference code: it forms the bias gradient from the
*dense* output gradient; here the sparsified gradient flows into the bias as
into the weight, so a unit that no example kept gets no update at all (and
its bias, like its weight row, costs nothing to communicate).

``K`` equal to the layer's width keeps every entry: the gradients are those
of the unmodified model, bit for bit.
"""
from __future__ import annotations

import functools
from typing import Dict


@functools.lru_cache(maxsize=None)
def _topk_function():
    import torch

    class TopKGradient(torch.autograd.Function):
        """Identity forward; backward keeps the ``k`` largest-magnitude
        entries of each row (last axis) of the incoming gradient."""

        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return keep_topk(grad, ctx.k), None

    return TopKGradient


def keep_topk(grad, k: int):
    """``grad`` with, in each row of its last axis, the ``k`` entries largest
    in magnitude kept and every other entry zero (ties: the lower index)."""
    import torch

    order = torch.sort(grad.abs(), dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(grad).scatter_(-1, order, grad.gather(-1, order))


def sparsify_backward(output, k: int):
    """``output`` unchanged in value; its gradient passes through
    :func:`keep_topk` on the way back."""
    return _topk_function().apply(output, k)


def layer_widths(net) -> Dict[str, int]:
    """The output widths of ``net``'s ``meprop_layers``."""
    modules = dict(net.named_modules())
    return {name: modules[name].out_features for name in net.meprop_layers}


def attach(net, k: int) -> list:
    """Apply meProp with ``k`` to ``net``'s ``meprop_layers`` (forward hooks
    that route each layer's output through :func:`sparsify_backward`);
    returns the hooks' handles (``handle.remove()`` undoes it)."""
    for name, width in layer_widths(net).items():
        if not 0 < k <= width:
            raise ValueError(f"meProp's k must be in [1, {width}] for {name}, not {k}")
    modules = dict(net.named_modules())
    return [modules[name].register_forward_hook(
                lambda module, inputs, output: sparsify_backward(output, k))
            for name in net.meprop_layers]


def validate(model: str, k: int) -> None:
    """Check ``train --meprop k`` for ``model`` (raises ``SystemExit``, the
    same on every rank: it depends on the command line only)."""
    if k == 0:
        return
    if k < 0:
        raise SystemExit(f"--meprop takes a positive number of units per layer (0: off), not {k}")
    if model == "mlp":
        raise SystemExit("--meprop needs a torch model (--model cnn or charlm); the numpy MLP "
                         "computes its backward by hand and has no meProp")
    from .models import torch_model

    for name, width in layer_widths(torch_model(model, 0)).items():
        if k > width:
            raise SystemExit(f"--meprop {k}: more units than {model}'s {name} has ({width})")
