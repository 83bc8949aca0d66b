"""hpccomm.optim on real MPI: each optimizer against a single-process reference
of its paper's algorithm, bit for bit, at every rank count the suite runs;
a resumed run equals the uninterrupted one across the freeze point.

The reference simulates the ``P`` ranks in one process: the paper's steps in
torch, the compressed momentum average of each tensor from
:class:`hpccomm.reference.Pipeline` (``twoshot`` with worker and owner
residuals, no MPI).  Gradients lie on a
grid of 2**-10 inside +-8, so that the warm-up's dense sums are exact in any
order (MPI may sum in its own).
"""
import numpy as np
import pytest

import hpccomm
from hpccomm.reference import Pipeline

from .helpers import COMM, RANK, SIZE, same_on_all_ranks

torch = pytest.importorskip("torch")
from hpccomm.optim import OneBitAdam  # noqa: E402

pytestmark = pytest.mark.mpi

SHAPES = [(7, 5), (13,), (3, 1, 4)]
LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8


def initial_weights():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def gradient(rank, step, index, x):
    """Rank ``rank``'s gradient of parameter ``index`` at ``step``: depends on
    the weights, on the 2**-10 grid inside +-8."""
    rng = np.random.default_rng([rank, step, index])
    g = 0.5 * x + rng.standard_normal(x.shape).astype(np.float32)
    return (np.clip(np.round(g * 1024), -8192, 8192) / 1024).astype(np.float32)


def run(steps, freeze, codec="onebit", start=None, stop=None, weight_decay=0.0,
        cls=OneBitAdam, memory=None, error_feedback=True):
    """This rank's OneBitAdam (or ``cls``) for steps ``[start or 0, stop or
    steps)``; ``start``: continue from ``(weights, state_dict)``; ``memory``:
    the compressed reducer's. Returns (weights, state)."""
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in
              (start[0] if start else initial_weights())]
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, freeze_step=freeze, comm=COMM,
              codec=codec, weight_decay=weight_decay, error_feedback=error_feedback)
    if memory is not None:
        opt.compressed.memory = memory
    if start:
        opt.load_state_dict(start[1])
    for t in range(opt.steps, stop if stop is not None else steps):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(gradient(RANK, t, i, p.detach().numpy()))
        opt.step()
    return [p.detach().numpy().copy() for p in params], opt.state_dict()


def reference(P, steps, freeze, codec="onebit", weight_decay=0.0, error_feedback=True):
    """The paper's Algorithm 1 on ``P`` simulated ranks (weights are the same on all)."""
    xs = [torch.from_numpy(w.copy()) for w in initial_weights()]
    beta1, beta2 = BETAS
    m = [[torch.zeros_like(x) for x in xs] for _ in range(P)]     # per rank
    v = [torch.zeros_like(x) for x in xs]
    pipes = [Pipeline(hpccomm.codecs.get_codec(codec), "twoshot", P, shape=tuple(x.shape),
                      error_feedback=error_feedback) for x in xs]     # a key per tensor
    for t in range(steps):
        gs = [[torch.from_numpy(gradient(r, t, i, x.numpy())) for i, x in enumerate(xs)]
              for r in range(P)]
        if t < freeze:      # exact Adam on the mean gradient
            mean = [sum(gs[r][i] for r in range(P)) / P for i in range(len(xs))]
            if weight_decay:
                mean = [g.add(x, alpha=weight_decay) for g, x in zip(mean, xs)]
            for r in range(P):
                for i in range(len(xs)):
                    m[r][i].mul_(beta1).add_(mean[i], alpha=1 - beta1)
            for i in range(len(xs)):
                v[i].mul_(beta2).addcmul_(mean[i], mean[i], value=1 - beta2)
            for i, x in enumerate(xs):
                m_hat = m[0][i] / (1 - beta1 ** (t + 1))
                v_hat = v[i] / (1 - beta2 ** (t + 1))
                x.addcdiv_(m_hat, v_hat.sqrt_().add_(EPS), value=-LR)
            continue
        if weight_decay:
            gs = [[g.add(x, alpha=weight_decay) for g, x in zip(gr, xs)] for gr in gs]
        for r in range(P):      # local momenta from local gradients
            for i in range(len(xs)):
                m[r][i].mul_(beta1).add_(gs[r][i], alpha=1 - beta1)
        for i, x in enumerate(xs):
            total = pipes[i]([m[r][i].numpy() for r in range(P)]).values
            avg = total / np.float32(P) if P > 1 else total
            part = torch.from_numpy(avg).view_as(x)
            for r in range(P):
                m[r][i].copy_(part)
            v_hat = v[i] / (1 - beta2 ** freeze)      # frozen at step freeze
            x.addcdiv_(m[0][i], v_hat.sqrt_().add_(EPS), value=-LR)
    return [x.numpy() for x in xs]


def _bits(arrays):
    return [a.view(np.uint32) for a in arrays]


@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
@pytest.mark.parametrize("freeze", [1, 3])
def test_onebit_adam_matches_the_paper_bit_for_bit(codec, freeze):
    got, _ = run(7, freeze, codec)
    same = same_on_all_ranks(np.concatenate([g.reshape(-1) for g in got]))
    want = reference(SIZE, 7, freeze, codec)
    for g, w in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(g, w)
    assert same


def test_without_error_feedback_matches_the_reference_without_residuals():
    """``error_feedback=False`` (the negative control) is the same algorithm
    with both residuals dropped, bit for bit."""
    got, _ = run(6, 2, error_feedback=False)
    want = reference(SIZE, 6, 2, error_feedback=False)
    for g, w in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(g, w)


def test_onebit_adam_with_weight_decay_matches_the_paper():
    got, _ = run(5, 2, weight_decay=0.01)
    want = reference(SIZE, 5, 2, weight_decay=0.01)
    for g, w in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(g, w)


class NeverFrozen(OneBitAdam):
    """v keeps following the (local) gradient after the freeze."""

    @staticmethod
    def _moments(state, g, beta1, beta2, frozen):
        OneBitAdam._moments(state, g, beta1, beta2, False)


class NoWarmup(OneBitAdam):
    """Compressed from the first step: no exact Adam, no variance."""

    @property
    def frozen(self):
        return True


def _mutants():
    from .mutants import DroppedOwnerResidual, DroppedResidual

    return {"variance not frozen": dict(cls=NeverFrozen),
            "warm-up skipped": dict(cls=NoWarmup),
            "momentum residual dropped": dict(memory=DroppedResidual()),
            "owner residual dropped": dict(memory=DroppedOwnerResidual())}


@pytest.mark.parametrize("mutant", ["variance not frozen", "warm-up skipped",
                                    "momentum residual dropped", "owner residual dropped"])
def test_each_broken_optimizer_fails_the_reference(mutant):
    """The bit-for-bit comparison catches each broken variant of the
    optimizer (the owner's residual exists from two ranks on)."""
    if mutant == "owner residual dropped" and SIZE == 1:
        pytest.skip("one rank: no owner re-encode")
    got, _ = run(7, 3, **_mutants()[mutant])
    want = reference(SIZE, 7, 3)
    assert any(not np.array_equal(g, w) for g, w in zip(_bits(got), _bits(want)))


@pytest.mark.parametrize("cut", [2, 3, 5])
def test_a_resumed_run_equals_the_uninterrupted_one(cut):
    """Stopped after ``cut`` steps (before, at and after the freeze at 3),
    saved, rebuilt from the state_dict, continued to 7 steps: the same bits."""
    whole, _ = run(7, 3)
    first, state = run(7, 3, stop=cut)
    resumed, _ = run(7, 3, start=(first, state))
    for a, b in zip(_bits(whole), _bits(resumed)):
        np.testing.assert_array_equal(a, b)


def test_bad_arguments_are_refused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam(p, freeze_step=0, comm=COMM)
    with pytest.raises(ValueError, match="betas"):
        OneBitAdam(p, betas=(1.0, 0.9), comm=COMM)
