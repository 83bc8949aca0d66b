"""hpccomm.optim on real MPI: each optimizer against a single-process reference
of its paper's algorithm, bit for bit, at 1, 2 and 3 ranks,
per tensor and in a GradReducer's buckets (with and without overlap); a
resumed run equals the uninterrupted one across the freeze point.

The references simulate the ``P`` ranks in one process: the paper's steps in
torch, the compressed average of each tensor (or bucket) from
:class:`hpccomm.reference.Pipeline` (``twoshot`` with worker and owner
residuals, no MPI).  Gradients lie on a
grid of 2**-10 inside +-8, so that the exact steps' dense sums are exact in
any order (MPI may sum in its own).
"""
import numpy as np
import pytest

import hpccomm
from hpccomm.reference import Pipeline

from .helpers import COMM, RANK, SIZE, same_on_all_ranks

# the optimizers' own logic, a layer above the collectives ("narrow": the suite runs
# it at 1-3 ranks); their collective (twoshot) is tested at every rank count by
# test_collectives_mpi.  Run by hand above 4 ranks, the file skips before torch is
# imported, which would cost each rank 1-2 s of a shared core.
if SIZE > 4:
    pytest.skip("the optimizers are checked at 1-4 ranks", allow_module_level=True)
torch = pytest.importorskip("torch")
from hpccomm.optim import OneBitAdam, ZeroOneAdam  # noqa: E402
from hpccomm.torch_grads import GradReducer  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

SHAPES = [(7, 5), (13,), (3, 1, 4)]
LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8
#: the tensors of each compressed reduction: one per tensor, or the buckets
#: of a GradReducer with bucket_bytes=BUCKET_BYTES (every tensor compressed)
PER_TENSOR, BUCKETS, BUCKET_BYTES = [[0], [1], [2]], [[0], [1, 2]], 160


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
        cls=OneBitAdam, memory=None, error_feedback=True, buckets=None, **options):
    """This rank's OneBitAdam (or ``cls``; ``freeze`` is its ``freeze_step``
    or ``var_freeze_step``) for steps ``[start or 0, stop or steps)``;
    ``start``: continue from ``(weights, state_dict)``; ``memory``: the
    compressed reducer's; ``buckets``: None (per tensor), ``"sync"`` or
    ``"overlap"`` (a GradReducer's buckets, the gradients from a backward).
    Returns (weights, state)."""
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in
              (start[0] if start else initial_weights())]
    grad_reducer = None
    if buckets is not None:
        grad_reducer = GradReducer([(f"w{i}", p) for i, p in enumerate(params)], COMM,
                                   codec="none", bucket_bytes=BUCKET_BYTES, min_compress=1,
                                   compress_1d=True, overlap=buckets == "overlap")
    freeze_name = "freeze_step" if issubclass(cls, OneBitAdam) else "var_freeze_step"
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, comm=COMM, codec=codec,
              weight_decay=weight_decay, error_feedback=error_feedback,
              grad_reducer=grad_reducer, **{freeze_name: freeze}, **options)
    if memory is not None:
        opt.compressed.memory = memory
    if start:
        opt.load_state_dict(start[1])
    for t in range(opt.steps, stop if stop is not None else steps):
        grads = [torch.from_numpy(gradient(RANK, t, i, p.detach().numpy()))
                 for i, p in enumerate(params)]
        if grad_reducer is None:
            for p, g in zip(params, grads):
                p.grad = g
        else:              # backward fills the buckets (and fires overlap's hooks)
            opt.zero_grad(set_to_none=False)
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            grad_reducer()
        opt.step()
    return [p.detach().numpy().copy() for p in params], opt.state_dict()


class Averager:
    """The compressed mean over ``P`` simulated ranks of per-tensor payloads,
    reduced as ``plan`` groups them (one Pipeline, one key, per group)."""

    def __init__(self, P, plan, codec="onebit", error_feedback=True):
        self.P, self.plan = P, plan
        self.pipes = [Pipeline(hpccomm.codecs.get_codec(codec), "twoshot", P,
                               shape=SHAPES[g[0]] if len(g) == 1
                               else (sum(int(np.prod(SHAPES[i])) for i in g),),
                               error_feedback=error_feedback) for g in plan]

    def __call__(self, payloads):
        """``payloads[r][i]``: rank ``r``'s tensor ``i``; returns the mean of each."""
        out = [None] * len(SHAPES)
        for group, pipe in zip(self.plan, self.pipes):
            flats = [np.concatenate([payloads[r][i].numpy().reshape(-1) for i in group])
                     for r in range(self.P)]
            total = pipe(flats).values.reshape(-1)
            avg = total / np.float32(self.P) if self.P > 1 else total
            at = 0
            for i in group:
                n = int(np.prod(SHAPES[i]))
                out[i] = torch.from_numpy(avg[at:at + n].copy()).view(SHAPES[i])
                at += n
        return out


def reference(P, steps, freeze, codec="onebit", weight_decay=0.0, error_feedback=True,
              plan=PER_TENSOR):
    """The paper's Algorithm 1 on ``P`` simulated ranks (weights are the same on all)."""
    xs = [torch.from_numpy(w.copy()) for w in initial_weights()]
    beta1, beta2 = BETAS
    m = [[torch.zeros_like(x) for x in xs] for _ in range(P)]     # per rank
    v = [torch.zeros_like(x) for x in xs]
    average = Averager(P, plan, codec, error_feedback)
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
        means = average(m)
        for i, x in enumerate(xs):
            for r in range(P):
                m[r][i].copy_(means[i])
            v_hat = v[i] / (1 - beta2 ** freeze)      # frozen at step freeze
            x.addcdiv_(m[0][i], v_hat.sqrt_().add_(EPS), value=-LR)
    return [x.numpy() for x in xs]


#: ZeroOneAdam's policy in these tests: T_v = {0, 1, 2, 4} (frozen at 5),
#: T_u = {0..4, 5, 7, 11, 15}: local steps 6, 8-10, 12-14; the clipper (4)
#: shortens the last gap from 8
ZERO_ONE = dict(var_update_scaler=2, local_step_scaler=1, local_step_clipper=4)


def zero_one_schedules(steps, var_freeze_step, var_update_scaler, local_step_scaler,
                       local_step_clipper):
    """``T_v`` and ``T_u`` of the paper's policies, listed up to ``steps``."""
    t_v, k, j = [], 0, 0
    while k < min(var_freeze_step, steps):
        t_v.append(k)
        k, j = k + 2 ** (j // var_update_scaler), j + 1
    t_u, k, j = list(range(min(var_freeze_step, steps))), var_freeze_step - 1, 0
    while True:
        k, j = k + min(2 ** (j // local_step_scaler), local_step_clipper), j + 1
        if k >= steps:
            return t_v, t_u
        t_u.append(k)


def zero_one_reference(P, steps, freeze, codec="onebit", weight_decay=0.0, plan=PER_TENSOR,
                       error_feedback=True, **policy):
    """0/1 Adam's Algorithm 1 on ``P`` simulated ranks, each with its own
    weights between synchronizations; returns rank 0's weights at the end
    (every rank's, when ``steps - 1`` is a synchronization)."""
    beta1, beta2 = BETAS
    t_v, t_u = zero_one_schedules(steps, freeze, **policy)
    x = [[torch.from_numpy(w.copy()) for w in initial_weights()] for _ in range(P)]
    anchor = [w.clone() for w in x[0]]                      # x_{t'}, the same on all ranks
    zeros = [torch.zeros(s) for s in SHAPES]
    m = [[z.clone() for z in zeros] for _ in range(P)]
    u = [[z.clone() for z in zeros] for _ in range(P)]
    v, updates, lr_sum = [z.clone() for z in zeros], 0, 0.0
    average = Averager(P, plan, codec, error_feedback)
    for t in range(steps):
        gamma = LR / (1 - beta1 ** (t + 1))
        gs = [[torch.from_numpy(gradient(r, t, i, x[r][i].numpy())) for i in range(len(SHAPES))]
              for r in range(P)]
        if t in t_v:        # exact: the mean gradient, v updated
            updates += 1
            for i in range(len(SHAPES)):
                g = sum(gs[r][i] for r in range(P)) / P
                if weight_decay:
                    g = g.add(x[0][i], alpha=weight_decay)
                v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                d = (v[i] / (1 - beta2 ** updates)).sqrt_().add_(EPS)
                for r in range(P):
                    m[r][i].mul_(beta1).add_(g, alpha=1 - beta1)
                    x[r][i].addcdiv_(m[r][i], d, value=-gamma)
            anchor = [w.clone() for w in x[0]]
            continue
        ds = [(v[i] / (1 - beta2 ** updates)).sqrt_().add_(EPS) for i in range(len(SHAPES))]
        for r in range(P):
            for i in range(len(SHAPES)):
                g = gs[r][i].add(x[r][i], alpha=weight_decay) if weight_decay else gs[r][i]
                m[r][i].mul_(beta1).add_(g, alpha=1 - beta1)
                u[r][i].add_(m[r][i], alpha=gamma)
        lr_sum += gamma
        if t in t_u:        # 1-bit sync of the accumulated updates
            u_bar = average(u)
            for r in range(P):
                for i in range(len(SHAPES)):
                    m[r][i] = u_bar[i] / lr_sum
                    x[r][i] = anchor[i].clone().addcdiv_(u_bar[i], ds[i], value=-1.0)
                    u[r][i].zero_()
            anchor, lr_sum = [w.clone() for w in x[0]], 0.0
        else:               # a local step
            for r in range(P):
                for i in range(len(SHAPES)):
                    x[r][i].addcdiv_(m[r][i], ds[i], value=-gamma)
    return [w.numpy() for w in x[0]]


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

    def _mode(self, t):
        return "compressed"


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


# -- in a GradReducer's buckets ---------------------------------------------------
class PayloadNotWritten(OneBitAdam):
    """The buckets reduce the gradients, not the momenta."""

    def _payload(self, index, group, p, g, t):
        super()._payload(index, group, p, g, t)
        return g


@pytest.mark.parametrize("buckets", ["sync", "overlap"])
def test_onebit_adam_in_buckets_matches_the_paper(buckets):
    """With a GradReducer the momenta are reduced bucket by bucket (one
    bucket of two tensors here), started from backward's hooks with
    overlap: the paper's algorithm with those buckets, bit for bit."""
    got, _ = run(7, 3, buckets=buckets)
    want = reference(SIZE, 7, 3, plan=BUCKETS)
    for g, w in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(g, w)
    assert same_on_all_ranks(np.concatenate([g.reshape(-1) for g in got]))
    broken, _ = run(7, 3, buckets=buckets, cls=PayloadNotWritten)
    assert any(not np.array_equal(g, w) for g, w in zip(_bits(broken), _bits(want)))


def test_buckets_resume_and_refuse_misuse():
    whole, _ = run(7, 3, buckets="overlap")
    first, state = run(7, 3, buckets="overlap", stop=4)
    resumed, _ = run(7, 3, buckets="overlap", start=(first, state))
    for a, b in zip(_bits(whole), _bits(resumed)):
        np.testing.assert_array_equal(a, b)
    p = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    with pytest.raises(ValueError, match="codec='none'"):
        OneBitAdam(p, comm=COMM, grad_reducer=GradReducer(p, COMM, codec="onebit"))
    with pytest.raises(ValueError, match="not this optimizer's"):
        OneBitAdam(p[:1], comm=COMM, grad_reducer=GradReducer(p, COMM))
    with pytest.raises(ValueError, match="staleness"):
        OneBitAdam(p, comm=COMM, grad_reducer=GradReducer(p, COMM, staleness=1))
    opt = OneBitAdam(p, comm=COMM, freeze_step=1, grad_reducer=GradReducer(p, COMM))
    for q in p:
        q.grad = torch.ones_like(q)
    opt.grad_reducer()
    opt.step()                    # exact
    with pytest.raises(RuntimeError, match="call the GradReducer"):
        opt.step()                # compressed, the buckets never reduced


# -- 0/1 Adam -----------------------------------------------------------------------
def test_zero_one_schedules_follow_the_papers_policies():
    """The steps the optimizer makes exact, compressed and local are the
    policies' T_v and T_u, listed independently."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    for freeze, policy in [(5, ZERO_ONE), (40, dict(var_update_scaler=3, local_step_scaler=2,
                                                    local_step_clipper=8)),
                           (1, dict(var_update_scaler=1, local_step_scaler=3,
                                    local_step_clipper=1000))]:
        opt = ZeroOneAdam(p, comm=COMM, var_freeze_step=freeze, **policy)
        kinds = []
        for _ in range(120):
            kinds.append(opt.next_mode)
            p[0].grad = torch.ones(2)
            opt.step()
        t_v, t_u = zero_one_schedules(120, freeze, **policy)
        assert [t for t, k in enumerate(kinds) if k == "exact"] == t_v
        assert [t for t, k in enumerate(kinds) if k != "local"] == t_u


@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
@pytest.mark.parametrize("buckets", [None, "overlap"])
def test_zero_one_adam_matches_the_paper_bit_for_bit(codec, buckets):
    """16 steps: exact (T_v), compressed, local steps and synchronizations
    after them; every rank ends on a synchronization with the same bits."""
    got, _ = run(16, 5, codec, cls=ZeroOneAdam, buckets=buckets, **ZERO_ONE)
    want = zero_one_reference(SIZE, 16, 5, codec, plan=PER_TENSOR if buckets is None
                              else BUCKETS, **ZERO_ONE)
    for g, w in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(g, w)
    assert same_on_all_ranks(np.concatenate([g.reshape(-1) for g in got]))


def test_zero_one_adam_with_weight_decay_in_local_steps():
    """Stopped after a local step (14): rank 0's weights are its own."""
    got, _ = run(14, 5, cls=ZeroOneAdam, weight_decay=0.01, **ZERO_ONE)
    if RANK == 0:
        want = zero_one_reference(SIZE, 14, 5, weight_decay=0.01, **ZERO_ONE)
        for g, w in zip(_bits(got), _bits(want)):
            np.testing.assert_array_equal(g, w)


def test_synchronize_ends_the_local_steps_everywhere_alike():
    """Stopped after local steps, the ranks' weights differ; synchronize()
    makes them the same bits everywhere, and a second call does nothing."""
    params = [torch.nn.Parameter(torch.from_numpy(w)) for w in initial_weights()]
    opt = ZeroOneAdam(params, lr=LR, comm=COMM, var_freeze_step=5, **ZERO_ONE)
    for t in range(14):           # 12-13 are local steps
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(gradient(RANK, t, i, p.detach().numpy()))
        opt.step()
    flat = lambda: np.concatenate([p.detach().numpy().reshape(-1) for p in params])  # noqa
    assert opt.pending == 2
    assert same_on_all_ranks(flat()) == (SIZE == 1)
    assert opt.synchronize()
    assert same_on_all_ranks(flat())
    assert same_on_all_ranks(np.concatenate([opt.state[p]["exp_avg"].numpy().reshape(-1)
                                             for p in params]))
    before = flat()
    assert not opt.synchronize()
    np.testing.assert_array_equal(flat(), before)


class EveryStepVariance(ZeroOneAdam):
    """v updated on every step before the freeze (no T_v policy)."""

    def _mode(self, t):
        return "exact" if t < self.var_freeze_step else super()._mode(t)


class NoLocalSteps(ZeroOneAdam):
    """Synchronizes on every step after the freeze."""

    def _mode(self, t):
        return "compressed" if t >= self.var_freeze_step else super()._mode(t)


class NoAnchor(ZeroOneAdam):
    """A synchronization moves each rank from its own weights, not from x_{t'}."""

    def _stepped(self, mode, t):
        super()._stepped(mode, t)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].pop("anchor", None)


@pytest.mark.parametrize("mutant", ["variance every step", "no local steps", "no anchor",
                                    "update residual dropped", "owner residual dropped"])
def test_each_broken_zero_one_adam_fails_the_reference(mutant):
    from .mutants import DroppedOwnerResidual, DroppedResidual

    if mutant in ("no anchor", "owner residual dropped") and SIZE == 1:
        pytest.skip("one rank: local steps land where a sync would, no owner re-encode")
    broken = {"variance every step": dict(cls=EveryStepVariance),
              "no local steps": dict(cls=NoLocalSteps),
              "no anchor": dict(cls=NoAnchor),
              "update residual dropped": dict(cls=ZeroOneAdam, memory=DroppedResidual()),
              "owner residual dropped": dict(cls=ZeroOneAdam, memory=DroppedOwnerResidual())}
    got, _ = run(16, 5, **broken[mutant], **ZERO_ONE)
    want = zero_one_reference(SIZE, 16, 5, **ZERO_ONE)
    assert any(not np.array_equal(g, w) for g, w in zip(_bits(got), _bits(want)))


@pytest.mark.parametrize("buckets", [None, "overlap"])
@pytest.mark.parametrize("cut", [3, 7, 9])
def test_a_resumed_zero_one_adam_equals_the_uninterrupted_one(cut, buckets):
    """Cut before the freeze (3), after a synchronization (7) and between
    local steps (9): the same bits at the end."""
    whole, _ = run(16, 5, cls=ZeroOneAdam, buckets=buckets, **ZERO_ONE)
    first, state = run(16, 5, cls=ZeroOneAdam, buckets=buckets, stop=cut, **ZERO_ONE)
    resumed, _ = run(16, 5, cls=ZeroOneAdam, buckets=buckets, start=(first, state),
                     **ZERO_ONE)
    for a, b in zip(_bits(whole), _bits(resumed)):
        np.testing.assert_array_equal(a, b)


def test_zero_one_adam_refuses_bad_policies():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                 "local_step_clipper"):
        with pytest.raises(ValueError, match=name):
            ZeroOneAdam(p, comm=COMM, **{name: 0})
    _, state = run(3, 5, cls=ZeroOneAdam, **ZERO_ONE)
    with pytest.raises(ValueError, match="saved with"):
        run(6, 5, cls=ZeroOneAdam, start=(initial_weights(), state),
            **dict(ZERO_ONE, local_step_clipper=8))
