"""Deep Gradient Compression's optimizer-side half (Lin et al., ICLR 2018).

The ``dgc`` codec (:mod:`hpccomm.codecs.dgc`) only *selects*.  What makes DGC
train as well as dense SGD happens around the communication, on each worker,
and lives here in :class:`DGCMomentum`:

* **momentum correction** -- accumulate the velocity, not the gradient:
  ``u = m u + g``, ``v = v + u`` (Nesterov: ``u = m (u + g)``,
  ``v = v + u + g``);
* **local gradient clipping** (optional) -- before accumulating, scale this
  rank's gradients so that their joint L2 norm is at most
  ``clip_norm / sqrt(nranks)`` (the paper's ``N**-1/2`` scaling);
* **selection** with DGC's sampled threshold (:func:`~hpccomm.codecs.dgc.dgc_select`)
  at the current density, and **momentum factor masking** -- once the selected
  entries are sent, ``v`` and ``u`` are zeroed there;
* **warm-up** -- the density falls exponentially over the first epochs,
  ``density(e) = max(c**(e + 1), ratio)`` with ``c = ratio**(1 / (warmup_epochs + 1))``
  (DGC's code; ratio 0.001 and 4 epochs give 25.1 %, 6.3 %, 1.58 %, 0.40 %,
  then 0.1 % -- the paper's 75 %, 93.75 %, 98.4375 %, 99.6 %, 99.9 % sparsity),
  or an explicit ``schedule`` of densities per epoch.

Use with an :class:`~hpccomm.Allreducer`
----------------------------------------
Without warm-up or clipping, the reducer does all of it itself:
``Allreducer(comm, codec="dgc", ratio=0.001, error_feedback=DGCMemory(0.9))``
(:class:`hpccomm.memory.DGCMemory`; the same bits as the wiring below).
With them, wire this class by hand.
DGC's accumulation ``v`` *is* the error feedback: what is not sent stays in
``v``.  So the Allreducer must not keep residuals of its own
(``error_feedback=False``), and it must deliver the selected entries
unchanged -- a codec that sends every non-zero of its input: ``topk`` with
``ratio=1.0`` (its packets hold exactly the non-zeros, 8 bytes each, with any
algorithm, including the owners' re-encoding in ``twoshot``), or a sparse
algorithm with codec ``none``.  (A codec that drops part of the selection,
such as ``dgc`` with a small ratio, would lose that part: it was masked here
as sent, and no residual keeps it.)  Every step::

    dgc = DGCMomentum(shapes, momentum=0.9, ratio=0.001, warmup_epochs=4,
                      seed=seed, rank=comm.rank)
    reducer = hpccomm.Allreducer(comm, codec="topk", ratio=1.0, op="mean",
                                 error_feedback=False)
    ...
    grads = model_gradients()                      # {name: array}
    to_send = dgc.accumulate(grads, epoch=epoch)   # selected v, zeros elsewhere
    for name, t in to_send.items():
        reducer(t, key=name, out=t)                # in place: the mean over ranks
    dgc.sent(to_send)                              # mask what this rank selected
    for name, t in to_send.items():
        params[name] -= lr * t                     # momentum is already in t

:meth:`DGCMomentum.sent` takes the names (a mapping's keys do; its values are
not read, so it does not matter that the reduce overwrote them) and masks the
positions :meth:`accumulate` selected on this rank.  Weight decay, if any, is
added to the gradient before :meth:`accumulate` or applied densely by the
optimizer, as in DGC's code.  DGC leaves one-dimensional tensors (biases,
norms) dense; passing them here is harmless (they are selected like the rest
and masked) -- or keep them out of ``shapes`` and reduce them densely.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Optional, Sequence

import numpy as np

from .codecs.sparsifier import check_fraction
from .codecs.base import EncodeContext
from .codecs.dgc import dgc_select


def warmup_density(epoch: int, ratio: float, warmup_epochs: int) -> float:
    """DGC's exponential sparsity warm-up: ``max(c**(epoch + 1), ratio)`` with
    ``c = ratio**(1 / (warmup_epochs + 1))``; ``ratio`` when
    ``warmup_epochs <= 0``."""
    if warmup_epochs <= 0:
        return ratio
    coeff = ratio ** (1.0 / (warmup_epochs + 1))
    return max(coeff ** (epoch + 1), ratio)


class DGCMomentum:
    """Momentum correction, clipping, masking and warm-up for DGC (see the
    module docstring for the maths and the use with an Allreducer).

    Parameters
    ----------
    shapes : mapping of name to shape
        The tensors (e.g. ``{name: p.shape}``); state ``u`` and ``v`` is kept
        per name, float32, initialised to zero.
    momentum : float
        The optimizer's momentum ``m`` (0.9 in DGC).  The optimizer itself then
        applies no momentum to the reduced gradient.
    ratio : float
        Final density (fraction of entries sent), DGC's ``compress_ratio``.
    warmup_epochs : int
        Epochs of exponential warm-up (:func:`warmup_density`); 0 disables it.
    schedule : sequence of float, optional
        Explicit density per epoch (e.g. ``[0.25, 0.0625, 0.015625, 0.004]``);
        ``ratio`` after its end.  Replaces ``warmup_epochs``.
    nesterov : bool
        Nesterov momentum correction.
    masking : bool
        Momentum factor masking (zero ``u`` where sent); ``v`` is always
        cleared where sent.
    clip_norm : float, optional
        Local gradient clipping: the joint L2 norm of each
        :meth:`accumulate` call's gradients is capped at
        ``clip_norm / sqrt(nranks)``.
    nranks : int
        Number of workers, for the clipping threshold.
    sample_ratio, max_iters : float, int
        DGC's threshold estimation (:mod:`hpccomm.codecs.dgc`).
    seed, rank : int
        The random stream of the threshold sampling (step = the number of
        :meth:`accumulate` calls so far).
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], momentum: float = 0.9,
                 ratio: float = 0.001, warmup_epochs: int = 4,
                 schedule: Optional[Sequence[float]] = None, nesterov: bool = False,
                 masking: bool = True, clip_norm: Optional[float] = None, nranks: int = 1,
                 sample_ratio: float = 0.01, max_iters: int = 10, seed: int = 0, rank: int = 0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), not {momentum!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, not {clip_norm!r}")
        if nranks < 1:
            raise ValueError(f"nranks must be >= 1, not {nranks!r}")
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.momentum = np.float32(momentum)
        self.ratio = check_fraction("ratio", ratio)
        self.warmup_epochs = int(warmup_epochs)
        self.schedule = None if schedule is None else [check_fraction("schedule entry", d)
                                                       for d in schedule]
        self.nesterov = bool(nesterov)
        self.masking = bool(masking)
        self.clip_norm = clip_norm
        self.nranks = int(nranks)
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)
        self.max_iters = int(max_iters)
        self.seed, self.rank = int(seed), int(rank)
        self.step = 0
        self.u = {k: np.zeros(s, dtype=np.float32) for k, s in self.shapes.items()}
        self.v = {k: np.zeros(s, dtype=np.float32) for k, s in self.shapes.items()}
        #: flat indices selected by the last accumulate(), per name, until sent()
        self.pending: Dict[str, np.ndarray] = {}

    def density(self, epoch: int) -> float:
        """Fraction of each tensor's entries selected during ``epoch``."""
        if self.schedule is not None:
            return self.schedule[epoch] if epoch < len(self.schedule) else self.ratio
        return warmup_density(epoch, self.ratio, self.warmup_epochs)

    def accumulate(self, grads: Mapping[str, np.ndarray], epoch: int = 0) -> Dict[str, np.ndarray]:
        """Clip, correct momentum, accumulate and select.

        Returns new float32 arrays, one per name of ``grads``: ``v`` at the
        ``max(1, ceil(density(epoch) n))`` (at most) positions DGC's threshold
        selects, zero elsewhere.  Call :meth:`sent` once they are on their way."""
        unknown = set(grads) - set(self.shapes)
        if unknown:
            raise KeyError(f"gradients of unknown tensors: {sorted(unknown)}")
        gs = {}
        for name, g in grads.items():
            g = np.asarray(g, dtype=np.float32)
            if g.shape != self.shapes[name]:
                raise ValueError(f"{name}: gradient of shape {g.shape}, expected "
                                 f"{self.shapes[name]}")
            gs[name] = g
        if self.clip_norm is not None:
            norm = math.sqrt(sum(float(np.dot(g.ravel().astype(np.float64),
                                              g.ravel().astype(np.float64)))
                                 for g in gs.values()))
            limit = self.clip_norm / math.sqrt(self.nranks)
            if norm > limit:
                scale = np.float32(limit / norm)
                gs = {name: g * scale for name, g in gs.items()}
        density = self.density(epoch)
        ctx = EncodeContext(seed=self.seed, rank=self.rank, step=self.step)
        out = {}
        for name, g in gs.items():
            u, v = self.u[name], self.v[name]
            if self.nesterov:
                u += g
                u *= self.momentum
                v += u
                v += g
            else:
                u *= self.momentum
                u += g
                v += u
            flat = v.reshape(-1)
            idx, vals = dgc_select(flat, density, self.sample_ratio, self.max_iters, ctx)
            send = np.zeros(flat.size, dtype=np.float32)
            send[idx] = vals
            out[name] = send.reshape(v.shape)
            self.pending[name] = idx
        self.step += 1
        return out

    def sent(self, names: Optional[Iterable[str]] = None) -> None:
        """Mask the positions the last :meth:`accumulate` selected: ``v = 0``
        there, and ``u = 0`` with ``masking``.  ``names``: the tensors whose
        vectors went out (a mapping works: only its keys are read); default
        every tensor still pending."""
        names = list(self.pending) if names is None else list(names)
        missing = [n for n in names if n not in self.pending]
        if missing:
            raise KeyError(f"no selection pending for {missing}: call accumulate() first")
        for name in names:
            idx = self.pending.pop(name)
            self.v[name].reshape(-1)[idx] = 0
            if self.masking:
                self.u[name].reshape(-1)[idx] = 0

    # -- checkpoints (DGC pitfall: lose u and v and accuracy dips on restart) --
    def state_dict(self) -> dict:
        return {"step": self.step, "u": {k: a.copy() for k, a in self.u.items()},
                "v": {k: a.copy() for k, a in self.v.items()}}

    def load_state_dict(self, state: dict) -> None:
        for slot in ("u", "v"):
            saved = state[slot]
            if set(saved) != set(self.shapes):
                raise KeyError(f"state holds tensors {sorted(saved)}, expected "
                               f"{sorted(self.shapes)}")
            for name, a in saved.items():
                a = np.asarray(a, dtype=np.float32)
                if a.shape != self.shapes[name]:
                    raise ValueError(f"{name}: saved {slot} of shape {a.shape}, expected "
                                     f"{self.shapes[name]}")
                getattr(self, slot)[name][...] = a
        self.step = int(state["step"])
        self.pending.clear()
