"""Compressed Adam: torch optimizers that reduce through hpccomm.

Both optimizers replace the gradient's reduction: call them where a plain
optimizer would get the mean gradient, on local gradients.  Their
reductions run inside :meth:`step`, one call per tensor, or -- given a
:class:`hpccomm.torch_grads.GradReducer` (``grad_reducer=``, made with
``codec="none"``) -- in its buckets and with its overlap (the section at the
end).

:class:`OneBitAdam` -- 1-bit Adam (Tang et al., ICML 2021, Algorithm 1).
Adam's second moment ``v`` is what compression breaks: error feedback
delivers the gradient late and in bursts, and ``v`` sees the bursts.  1-bit
Adam therefore runs exact Adam for a warm-up, then freezes ``v`` and
compresses the *momentum* instead of the gradient, with error feedback on
both sides of the reduction.  With the paper's symbols -- ``x`` the weights,
``g^(i)`` rank ``i``'s local gradient, ``n`` ranks, ``gamma`` the learning
rate, ``C`` the compressor, ``delta^(i)`` the worker errors and
``delta-bar`` the server's:

1. **Warm-up**, steps ``t = 1 .. T_w`` (``freeze_step``): exact Adam on
   the mean gradient ``g = 1/n sum_i g^(i)`` (one dense ``MPI_Allreduce``)::

       m_t = beta1 m_{t-1} + (1 - beta1) g_t
       v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
       x_{t+1} = x_t - gamma (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)

2. **Freeze**: ``v`` is kept as it was after step ``T_w``, bias-corrected:
   ``v* = v_{T_w} / (1 - beta2^T_w)`` (the paper's ``v_{T_w}``; Algorithm 1
   writes no bias correction anywhere, and correcting it here keeps the step
   size continuous across the freeze, which an uncorrected ``v_{T_w}`` after
   100 steps of ``beta2 = 0.999`` would make 3.2x larger).
3. **Compression**, steps ``t > T_w``: every rank updates its *local*
   momentum from its *local* gradient (no gradient is reduced),
   ``m_t^(i) = beta1 m_{t-1} + (1 - beta1) g_t^(i)``; the momenta are
   averaged through the compressed collective with error feedback on the
   workers, ``m-hat^(i) = C[m_t^(i) + delta^(i)]``, ``delta^(i) = m_t^(i) +
   delta^(i) - m-hat^(i)``, and on the server, ``m_t = C[1/n sum_i m-hat^(i)
   + delta-bar]``, ``delta-bar = ... - m_t``; every rank sets ``m_t^(i) =
   m_t`` and ``x_{t+1} = x_t - gamma m_t / (sqrt(v*) + eps)``.

Step 3 is hpccomm's ``twoshot`` with the plain residual memory on workers
and owners (the owner of a chunk is the paper's server for it), ``op="mean"``
and the codec of your choice (``onebit``, the paper's, by default).
``twoshot``'s owner compresses the *sum* of the decoded packets plus its
residual and the mean is taken after the decode: for the scale-equivariant
``onebit`` that is the paper's ``C[1/n sum + delta-bar]`` with ``delta-bar``
kept ``n`` times larger.  Every rank ends every step with the same momentum
and the same weights, bit for bit.

Weight decay (``weight_decay``) is added to the gradient, as torch's ``Adam``
does: to the mean gradient in the warm-up (the weights are the same on every
rank, so ``mean(g^(i) + wd x) = mean(g^(i)) + wd x``), to the local one
after.  The warm-up reduces each group's gradients as one flat float32
vector; the momentum is reduced per tensor, each under its own key and with
its own shape (so ``onebit`` scales each column of each tensor, as Seide et
al. do; with one scale for a whole model a tensor of small values takes the
large ones' steps).  A short warm-up is unstable whatever the codec (``none``
too): a coordinate whose gradient was near zero before the freeze keeps a
near-zero ``v*`` and takes ``m / eps``-sized steps once its gradient grows --
the paper's warm-up is 15-25 % of the run.  Every rank
must hold the same parameters (shapes and order) and call :meth:`step` the
same number of times.  :meth:`state_dict` holds, besides torch's per
parameter state (``exp_avg``, ``exp_avg_sq`` -- frozen after ``T_w``), the
step count and the reducers' residuals; a run resumed from it equals the
uninterrupted run, bit for bit.  Every rank saves and loads its own (the
residuals differ between ranks).

:class:`ZeroOneAdam` -- 0/1 Adam (Lu et al., ICLR 2023, Algorithm 1).  1-bit
Adam still sends every step and needs a warm-up of exact steps chosen by hand.
0/1 Adam instead updates ``v`` only at the steps of a schedule ``T_v`` whose
gaps double (exact steps, dense), compresses from the first step that is not
in ``T_v``, and once ``v`` is frozen for good skips rounds: every rank runs
*local* steps with its own momentum and synchronizes only at the steps of
``T_u``, whose gaps double too.  With ``gamma_t`` the step size, ``u^(i)``
rank ``i``'s update accumulated since the last synchronization at step
``t'`` and ``x_{t'}`` the weights there (the same on every rank), step ``t``
(from 0) is:

1. If ``t`` is in ``T_v``: exact Adam on the mean gradient ``g`` (one dense
   ``MPI_Allreduce``): ``m = beta1 m + (1 - beta1) g``,
   ``v = beta2 v + (1 - beta2) g^2``, ``x = x - gamma_t m / (sqrt(v-hat) + eps)``.
2. Otherwise, on every rank: ``m^(i) = beta1 m^(i) + (1 - beta1) g^(i)``
   (the local gradient) and ``u^(i) = u^(i) + gamma_t m^(i)``; then
   - if ``t`` is in ``T_u`` (1-bit sync): ``u-bar = C-mean(u^(i))`` through
     ``twoshot`` with worker and owner error feedback (as in 1-bit Adam);
     ``m = u-bar / sum_{k=t'+1..t} gamma_k`` and ``x = x_{t'} - u-bar /
     (sqrt(v-hat) + eps)`` on every rank, the same bits everywhere; ``u = 0``;
   - else (a local step): ``x^(i) = x^(i) - gamma_t m^(i) / (sqrt(v-hat) + eps)``.

The policies, from the paper (and the ``var_update_scaler``,
``local_step_scaler`` and ``local_step_clipper`` of its authors' tutorial):

- ``T_v``: ``k_0 = 0``, ``k_{j+1} = k_j + 2^floor(j / kappa)`` with ``kappa``
  = ``var_update_scaler``, up to ``var_freeze_step`` (excluded): the variance
  is updated every step ``kappa`` times, then every 2nd step ``kappa`` times,
  every 4th... and never from ``var_freeze_step`` on.
- ``T_u``: every step before ``var_freeze_step``; from there the gap between
  synchronizations is ``min(2^floor(j / alpha), local_step_clipper)`` for the
  ``j``-th synchronization counted from step ``var_freeze_step - 1`` (``j =
  0``), with ``alpha`` = ``local_step_scaler``: ``alpha`` synchronizations 1
  step apart, then ``alpha`` 2 steps apart, ..., never more than
  ``local_step_clipper`` steps apart.

Two choices the paper leaves open, made here as in Adam: the step uses the
variance that includes the step's own gradient (Algorithm 1 updates ``v``
after the step, which at ``t = 0`` would divide by ``eps``); and both moments
are bias-corrected -- ``gamma_t = lr / (1 - beta1^(t+1))`` and ``v-hat = v /
(1 - beta2^n)`` after ``n`` updates of ``v`` -- so that the step size is
Adam's through every phase (``u``, ``m = u-bar / sum gamma`` and the weights
all use the same ``gamma_t``).  Weight decay is added to the gradient, as in
:class:`OneBitAdam`.  :meth:`ZeroOneAdam.state_dict` holds the residuals,
the local accumulation ``u``, the weights at the last synchronization and
the schedules' positions; a resumed run equals the uninterrupted one bit for
bit (so, unlike the authors' implementation, a checkpoint need not reset
``u`` -- but it must be loaded at the same number of ranks).

**With a GradReducer.**  ``grad_reducer=GradReducer(model, codec="none",
...)`` hands the reductions to its buckets: exact steps reduce the gradients
there as any training would (overlapped with backward with ``overlap=True``),
and the other steps take the buckets over (:meth:`GradReducer.reduce_with`):
as a bucket's gradients are final, the optimizer computes its tensors'
momenta (1-bit Adam) or accumulated updates (0/1 Adam, at synchronizations)
into the bucket and starts its compressed reduction -- during backward with
``overlap=True`` -- and :meth:`step` applies the result.  The bucket keys
follow the GradReducer's plan; its dense buckets (small and 1-D tensors) are
averaged exactly, with ``MPI_Allreduce``, in every phase.  The loop stays
``backward(); grad_reducer(); opt.step()``, and with ``overlap=True`` the
learning rate of a step must be set before its backward (the buckets are
computed there).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .core import Allreducer

try:
    import torch
except ImportError:     # pragma: no cover -- torch is optional for hpccomm
    torch = None

_Optimizer = torch.optim.Optimizer if torch is not None else object
_no_grad = torch.no_grad() if torch is not None else (lambda f: f)

#: the three kinds of step (:attr:`_ReducedAdam.next_mode`)
EXACT, COMPRESSED, LOCAL = "exact", "compressed", "local"


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    return value


class _ReducedAdam(_Optimizer):
    """What :class:`OneBitAdam` and :class:`ZeroOneAdam` share: Adam's
    arguments, the exact and the compressed reducer, and where their
    reductions run (per tensor in :meth:`step`, or in a GradReducer's
    buckets).  A subclass says which kind each step is (:meth:`_mode`) and
    what it does: :meth:`_exact` (given the mean gradients),
    :meth:`_payload` (the tensor to reduce, from a local gradient),
    :meth:`_synced` (given the payloads' compressed mean) and :meth:`_local`."""

    #: the compressed keys' prefix (one key per tensor, or per bucket)
    key = "compressed"

    def __init__(self, params, defaults: dict, *, comm, codec, codec_options, seed,
                 error_feedback, grad_reducer):
        if torch is None:     # pragma: no cover
            raise ImportError("hpccomm.optim needs torch")
        if not 0.0 <= defaults["lr"]:
            raise ValueError(f"lr must be >= 0, not {defaults['lr']}")
        betas = defaults["betas"]
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), not {betas}")
        super().__init__(params, defaults)
        if grad_reducer is not None and comm is None:
            comm = grad_reducer.reducer.parent
        self.dense = Allreducer(comm, codec="none", algorithm="mpi", op="mean")
        self.compressed = Allreducer(comm, codec=codec, algorithm="twoshot", op="mean",
                                     error_feedback=bool(error_feedback), seed=seed,
                                     codec_options=dict(codec_options or {}))
        #: steps taken (the same on every rank), and how many of each kind
        self.steps = 0
        self.rounds = {EXACT: 0, COMPRESSED: 0, LOCAL: 0}
        #: per bucket of the GradReducer: (parameter, group index, offset) of its tensors
        self._members: List[list] = []
        #: buckets whose payload this step has started
        self._started = 0
        self.grad_reducer = grad_reducer
        if grad_reducer is not None:
            self._attach(grad_reducer)

    # -- the kinds of step (subclasses) ------------------------------------------
    def _mode(self, t: int) -> str:
        raise NotImplementedError

    def _exact(self, index: int, group: dict, params: list, grads: list, t: int) -> None:
        raise NotImplementedError

    def _payload(self, index: int, group: dict, p, g, t: int):
        raise NotImplementedError

    def _synced(self, index: int, group: dict, params: list, means: list, t: int) -> None:
        raise NotImplementedError

    def _local(self, index: int, group: dict, params: list, t: int) -> None:
        raise NotImplementedError

    def _stepped(self, mode: str, t: int) -> None:
        """After step ``t`` of kind ``mode`` (the schedules move on)."""

    @property
    def next_mode(self) -> str:
        """The kind of the coming step: ``"exact"`` (dense gradients),
        ``"compressed"`` (a compressed reduction) or ``"local"`` (none)."""
        return self._mode(self.steps)

    # -- the step -----------------------------------------------------------------
    @_no_grad
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.steps
        mode = self._mode(t)
        buckets = self.grad_reducer is not None
        if buckets and mode == COMPRESSED and self._started != len(self._members):
            raise RuntimeError(f"{type(self).__name__}.step(): {self._started} of "
                               f"{len(self._members)} buckets were reduced; call the "
                               "GradReducer after backward and before step()")
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise TypeError(f"{type(self).__name__} does not take sparse gradients")
                if not self.state[p]:
                    self._init_state(self.state[p], p)
            if mode == EXACT:
                grads = [p.grad for p in params]      # reduced in the buckets already
                if not buckets:
                    grads = _split(self._mean(grads, f"grad{index}"), params)
                self._exact(index, group, params, grads, t)
            elif mode == COMPRESSED:
                if buckets:          # the buckets hold the payloads' means
                    means = [p.grad for p in params]
                else:
                    means = [self.compressed(self._payload(index, group, p, p.grad, t)
                                             .detach().to(torch.float32).contiguous(),
                                             key=f"{self.key}{index}.{j}")
                             for j, p in enumerate(params)]
                self._synced(index, group, params, means, t)
            else:
                self._local(index, group, params, t)
        self.steps += 1
        self.rounds[mode] += 1
        self._stepped(mode, t)
        self._plan_buckets()
        return loss

    def _init_state(self, state: dict, p) -> None:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _mean(self, tensors, key: str):
        """The exact mean over ranks of ``tensors`` (flattened together,
        float32), as one torch tensor on their device."""
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        return self.dense(flat, key=key)

    @staticmethod
    def _decayed(group: dict, p, g):
        """``g + weight_decay * p`` (``g`` itself without weight decay)."""
        return g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g

    # -- in a GradReducer's buckets ----------------------------------------------
    def _attach(self, reducer) -> None:
        if reducer.staleness:
            raise ValueError("grad_reducer: a GradReducer with staleness does not carry "
                             f"{type(self).__name__}")
        if reducer.reducer.codec.name != "none" or reducer.reducer.op != "mean":
            raise ValueError("grad_reducer: exact steps need the mean gradient: make the "
                             "GradReducer with codec='none' and op='mean'")
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        named = dict(reducer.named)
        if set(map(id, named.values())) != set(group_of):
            raise ValueError("grad_reducer: its parameters are not this optimizer's")
        for b in reducer.buckets:
            self._members.append([(named[n], group_of[id(named[n])], off)
                                  for n, off in zip(b.names, b.offsets)])
        self._plan_buckets()

    def _plan_buckets(self) -> None:
        """Tell the GradReducer what the coming step reduces in its buckets."""
        self._started = 0
        if self.grad_reducer is not None:
            mode = self._mode(self.steps)
            self.grad_reducer.reduce_with(None if mode == EXACT else self._start_bucket)

    def _start_bucket(self, i: int, flat):
        """GradReducer's bucket ``i`` is complete: write its tensors' payloads
        over their gradients and start their mean (none at a local step)."""
        t = self.steps
        if self._mode(t) == LOCAL:
            return None
        with torch.no_grad():         # called from autograd's hooks with overlap=True
            for p, index, off in self._members[i]:
                state = self.state[p]
                if not state:
                    self._init_state(state, p)
                g = flat[off:off + p.numel()].view_as(p)
                g.copy_(self._payload(index, self.param_groups[index], p, g, t))
        b = self.grad_reducer.buckets[i]
        target = flat.reshape(b.shape)
        self._started += 1
        reducer = self.dense if b.dense else self.compressed
        return reducer.start(target, key=f"{self.key}/{b.key}", out=target, layout=b.shapes)

    # -- state --------------------------------------------------------------------
    def _extra_state(self) -> Dict[str, Any]:
        return {"steps": self.steps}

    def _load_extra_state(self, extra: Dict[str, Any]) -> None:
        self.steps = int(extra["steps"])

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["hpccomm"] = dict(self._extra_state(), compressed=self.compressed.state_dict(),
                             dense=self.dense.state_dict(), rounds=dict(self.rounds))
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("hpccomm")
        self._check_extra_state(extra)
        super().load_state_dict(state_dict)
        self.compressed.load_state_dict(extra["compressed"])
        if "dense" in extra:
            self.dense.load_state_dict(extra["dense"])
        self._load_extra_state(extra)
        self.rounds.update(extra.get("rounds", {}))
        self._plan_buckets()

    def _check_extra_state(self, extra: Dict[str, Any]) -> None:
        """Raise ValueError where ``extra`` was saved with other settings."""


class OneBitAdam(_ReducedAdam):
    """1-bit Adam (see the module docstring).

    Parameters
    ----------
    params, lr, betas, eps, weight_decay:
        As for ``torch.optim.Adam``.
    freeze_step:
        ``T_w``: the steps of exact Adam (dense reduction of the gradient)
        before ``v`` is frozen and the momentum is compressed.
    comm:
        The communicator (default ``MPI.COMM_WORLD``, or the GradReducer's).
    codec:
        The momentum's codec (default ``"onebit"``), any of hpccomm's; its
        options go in ``codec_options``.  Reduced through ``twoshot`` with
        worker and owner error feedback.
    error_feedback:
        ``False`` drops both residuals: not 1-bit Adam, the ablation that
        shows what they do (a negative control).
    grad_reducer:
        A :class:`hpccomm.torch_grads.GradReducer` over the same parameters
        (``codec="none"``) whose buckets and overlap carry the reductions.
    """

    key = "momentum"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100, comm=None,
                 codec: Any = "onebit", codec_options: Optional[dict] = None, seed: int = 0,
                 error_feedback: bool = True, grad_reducer=None):
        self.freeze_step = _positive_int("freeze_step", freeze_step)
        #: per parameter, ``((eps, betas), sqrt(v*) + eps)`` once v is frozen
        #: (derived from the state)
        self._denominators: Dict[Any, Any] = {}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay),
                         comm=comm, codec=codec, codec_options=codec_options, seed=seed,
                         error_feedback=error_feedback, grad_reducer=grad_reducer)

    @property
    def frozen(self) -> bool:
        """Whether ``v`` is frozen and the momentum compressed (after ``T_w`` steps)."""
        return self.steps >= self.freeze_step

    def _mode(self, t: int) -> str:
        return EXACT if t < self.freeze_step else COMPRESSED

    def _exact(self, index, group, params, grads, t):
        """1. Exact Adam on the mean gradient."""
        beta1, beta2 = group["betas"]
        for p, g in zip(params, grads):
            self._moments(self.state[p], self._decayed(group, p, g), beta1, beta2, False)
        for p in params:
            state = self.state[p]
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** (t + 1))
            m_hat = state["exp_avg"] / (1 - beta1 ** (t + 1))
            p.addcdiv_(m_hat, v_hat.sqrt_().add_(group["eps"]), value=-group["lr"])

    def _payload(self, index, group, p, g, t):
        """3. The local momentum (``v`` frozen), to be averaged."""
        state = self.state[p]
        self._moments(state, self._decayed(group, p, g), *group["betas"], True)
        return state["exp_avg"]

    def _synced(self, index, group, params, means, t):
        """3. Every rank takes the averaged momentum; the step divides by the frozen ``v``."""
        for p, m in zip(params, means):
            self.state[p]["exp_avg"].copy_(m)
            p.addcdiv_(self.state[p]["exp_avg"], self._frozen_denominator(p, group),
                       value=-group["lr"])

    def _frozen_denominator(self, p, group):
        """``sqrt(v*) + eps`` of ``p``, with ``v*`` the variance frozen at step
        ``T_w``, bias-corrected: made on the first compressed step (again
        after a load, or when the group's ``eps`` or ``betas`` change) and
        kept, since v no longer changes."""
        made = self._denominators.get(p)
        if made is None or made[0] != (group["eps"], group["betas"]):
            v_star = self.state[p]["exp_avg_sq"] / (1 - group["betas"][1] ** self.freeze_step)
            made = self._denominators[p] = ((group["eps"], group["betas"]),
                                            v_star.sqrt_().add_(group["eps"]))
        return made[1]

    @staticmethod
    def _moments(state, g, beta1: float, beta2: float, frozen: bool) -> None:
        """``m = beta1 m + (1 - beta1) g``; ``v`` likewise from ``g**2`` until frozen."""
        state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        if not frozen:
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)

    def _extra_state(self):
        return {"steps": self.steps, "freeze_step": self.freeze_step}

    def _check_extra_state(self, extra):
        if extra["freeze_step"] != self.freeze_step:
            raise ValueError(f"state_dict was saved with freeze_step={extra['freeze_step']}, "
                             f"this optimizer has {self.freeze_step}")

    def _load_extra_state(self, extra):
        self.steps = int(extra["steps"])
        self._denominators.clear()


class ZeroOneAdam(_ReducedAdam):
    """0/1 Adam (see the module docstring).

    Parameters
    ----------
    params, lr, betas, eps, weight_decay, comm, codec, codec_options, seed,
    error_feedback, grad_reducer:
        As for :class:`OneBitAdam`; ``codec`` compresses the accumulated
        update ``u`` at each synchronization.
    var_freeze_step:
        The step from which ``v`` is never updated and local steps begin
        (the end of the learning-rate warm-up, in the paper).
    var_update_scaler:
        ``kappa``: the variance updates between two doublings of their gap.
    local_step_scaler:
        ``alpha``: the synchronizations between two doublings of their gap.
    local_step_clipper:
        The largest gap between two synchronizations, in steps.
    """

    key = "update"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 1000,
                 var_update_scaler: int = 16, local_step_scaler: int = 1000,
                 local_step_clipper: int = 16, comm=None, codec: Any = "onebit",
                 codec_options: Optional[dict] = None, seed: int = 0,
                 error_feedback: bool = True, grad_reducer=None):
        self.var_freeze_step = _positive_int("var_freeze_step", var_freeze_step)
        self.var_update_scaler = _positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("local_step_clipper", local_step_clipper)
        #: T_v: the variance updates made, and the step of the next
        self.var_updates, self.next_var_step = 0, 0
        #: T_u after the freeze: the synchronizations counted from step
        #: var_freeze_step - 1, and the step of the next
        self.syncs, self.next_sync = 0, self.var_freeze_step
        #: local steps since the last synchronization, and per group the sum
        #: of the step sizes since then
        self.pending = 0
        self._lr_sums: List[float] = []
        #: per parameter, ``((eps, beta2, var_updates), sqrt(v-hat) + eps)``
        self._denominators: Dict[Any, Any] = {}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay),
                         comm=comm, codec=codec, codec_options=codec_options, seed=seed,
                         error_feedback=error_feedback, grad_reducer=grad_reducer)
        self._lr_sums = [0.0] * len(self.param_groups)

    def _mode(self, t: int) -> str:
        if t < self.var_freeze_step:
            return EXACT if t == self.next_var_step else COMPRESSED
        return COMPRESSED if t == self.next_sync else LOCAL

    def _init_state(self, state, p):
        super()._init_state(state, p)
        state["update"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @staticmethod
    def _gamma(group: dict, t: int) -> float:
        """``gamma_t``: the step size, Adam's bias correction of ``m`` folded in."""
        return group["lr"] / (1 - group["betas"][0] ** (t + 1))

    def _denominator(self, p, group, updates: int):
        """``sqrt(v / (1 - beta2^n)) + eps`` after ``n = updates`` updates of
        ``v``: kept until ``v`` changes."""
        tag = (group["eps"], group["betas"][1], updates)
        made = self._denominators.get(p)
        if made is None or made[0] != tag:
            v_hat = self.state[p]["exp_avg_sq"] / (1 - group["betas"][1] ** updates)
            made = self._denominators[p] = (tag, v_hat.sqrt_().add_(group["eps"]))
        return made[1]

    def _exact(self, index, group, params, grads, t):
        """1. A step of ``T_v``: Adam on the mean gradient, ``v`` updated."""
        beta1, beta2 = group["betas"]
        gamma = self._gamma(group, t)
        for p, g in zip(params, grads):
            g = self._decayed(group, p, g)
            state = self.state[p]
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(state["exp_avg"], self._denominator(p, group, self.var_updates + 1),
                       value=-gamma)

    def _advance(self, group, p, g, t):
        """2. The local momentum and accumulated update of ``p``."""
        state = self.state[p]
        state["exp_avg"].mul_(group["betas"][0]).add_(self._decayed(group, p, g),
                                                      alpha=1 - group["betas"][0])
        state["update"].add_(state["exp_avg"], alpha=self._gamma(group, t))

    def _payload(self, index, group, p, g, t):
        self._advance(group, p, g, t)
        return self.state[p]["update"]

    def _synced(self, index, group, params, means, t):
        """2. A 1-bit sync: the same momentum and weights on every rank."""
        self._apply(index, group, params, means, self._lr_sums[index] + self._gamma(group, t))

    def _apply(self, index, group, params, means, lr_sum: float) -> None:
        """``u-bar`` = ``means`` averaged over ``lr_sum``'s steps: applied from ``x_{t'}``."""
        for p, u_bar in zip(params, means):
            state = self.state[p]
            torch.div(u_bar, lr_sum, out=state["exp_avg"])
            if "anchor" in state:                 # x_{t'}: after local steps
                p.copy_(state["anchor"])
            p.addcdiv_(u_bar, self._denominator(p, group, self.var_updates), value=-1.0)
            state["update"].zero_()
        self._lr_sums[index] = 0.0

    def _local(self, index, group, params, t):
        """2. A local step: no communication."""
        gamma = self._gamma(group, t)
        for p in params:
            self._advance(group, p, p.grad, t)
            p.addcdiv_(self.state[p]["exp_avg"], self._denominator(p, group, self.var_updates),
                       value=-gamma)
        self._lr_sums[index] += gamma

    @_no_grad
    def synchronize(self) -> bool:
        """End the local steps now (collective): the updates the ranks
        accumulated since the last synchronization, averaged *exactly* (one
        dense allreduce per group), are applied from ``x_{t'}`` as a
        synchronization applies them, so that every rank holds the same
        weights and momentum.  For the end of training, or an evaluation or
        checkpoint that must be the same on every rank; the schedules are not
        moved.  Returns False when there was nothing to do (no local step
        since the last synchronization)."""
        if not self.pending:
            return False
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if "update" in self.state[p]]
            if params:
                means = _split(self._mean([self.state[p]["update"] for p in params],
                                          f"synchronize{index}"), params)
                self._apply(index, group, params, means, self._lr_sums[index])
        self._anchor()
        self.pending = 0
        return True

    def _anchor(self) -> None:
        """``x_{t'}`` = the weights now, for the local steps to come."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" in state:
                    if "anchor" in state:
                        state["anchor"].copy_(p)
                    else:
                        state["anchor"] = p.detach().clone()

    def _stepped(self, mode, t):
        if mode == EXACT:
            self.var_updates += 1
            self.next_var_step = t + 2 ** ((self.var_updates - 1) // self.var_update_scaler)
        if mode != LOCAL and t + 1 >= self.var_freeze_step:
            if t >= self.var_freeze_step:     # a synchronization of T_u
                self.next_sync = t + min(2 ** (self.syncs // self.local_step_scaler),
                                         self.local_step_clipper)
            self.syncs += 1
            self._anchor()
        self.pending = self.pending + 1 if mode == LOCAL else 0

    def _extra_state(self):
        return {"steps": self.steps, "var_updates": self.var_updates,
                "next_var_step": self.next_var_step, "syncs": self.syncs,
                "next_sync": self.next_sync, "pending": self.pending,
                "lr_sums": list(self._lr_sums),
                "policy": self._policy()}

    def _policy(self):
        return {"var_freeze_step": self.var_freeze_step,
                "var_update_scaler": self.var_update_scaler,
                "local_step_scaler": self.local_step_scaler,
                "local_step_clipper": self.local_step_clipper}

    def _check_extra_state(self, extra):
        if extra["policy"] != self._policy():
            raise ValueError(f"state_dict was saved with {extra['policy']}, "
                             f"this optimizer has {self._policy()}")

    def _load_extra_state(self, extra):
        for name in ("steps", "var_updates", "next_var_step", "syncs", "next_sync", "pending"):
            setattr(self, name, int(extra[name]))
        self._lr_sums = [float(s) for s in extra["lr_sums"]]
        self._denominators.clear()


def _split(flat, params):
    """``flat`` cut into tensors shaped like ``params`` (views)."""
    out, at = [], 0
    for p in params:
        n = p.numel()
        out.append(flat[at:at + n].view_as(p).to(p.dtype))
        at += n
    return out


__all__ = ["OneBitAdam", "ZeroOneAdam"]
