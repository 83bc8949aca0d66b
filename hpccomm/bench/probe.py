"""How far the reduced gradient is from the exact one, measured during
training (``train --probe-every K``): the evidence for a codec that misses
fp32's accuracy.

Every ``K``-th step the probe takes the ranks' local gradients before the
reduction, averages them exactly (float64 ``MPI_Allreduce``) and compares the
optimizer's input after the reduction with it:

* ``step``: the relative L2 error ``||r - g|| / ||g||`` of that step, averaged
  over the probed steps -- the per-step variance (and bias) the codec adds;
* ``cumulative``: ``||sum r - sum g|| / ||sum g||`` over the probed steps -- what
  error feedback is for: its per-step error is large, but what it has sent
  tracks what it should have sent, and this stays small (exactly: the
  residual left at the end, over the sum -- with ``K = 1``; probing fewer
  steps leaves out what the others sent).

A probed step reduces without overlap (the local gradient is read before the
reduction overwrites it); the results are bit-identical either way.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


class GradientProbe:
    def __init__(self, comm, every: int):
        self.comm, self.every = comm, int(every)
        self.count, self.step_err = 0, 0.0
        self.sum_exact = self.sum_reduced = None
        self._exact = None

    def active(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @staticmethod
    def _flat(grads: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(g, dtype=np.float64).ravel() for g in grads])

    def before(self, grads: Sequence[np.ndarray]) -> None:
        """The local gradients, before the reduction."""
        from mpi4py import MPI

        local = self._flat(grads)
        self._exact = np.empty_like(local)
        self.comm.Allreduce(local, self._exact, op=MPI.SUM)
        self._exact /= self.comm.Get_size()

    def after(self, grads: Sequence[np.ndarray]) -> None:
        """What the optimizer receives, after the reduction."""
        reduced, exact = self._flat(grads), self._exact
        norm = float(np.linalg.norm(exact))
        if norm > 0:
            self.step_err += float(np.linalg.norm(reduced - exact)) / norm
            self.count += 1
        if self.sum_exact is None:
            self.sum_exact, self.sum_reduced = np.zeros_like(exact), np.zeros_like(exact)
        self.sum_exact += exact
        self.sum_reduced += reduced
        self._exact = None

    def summary(self) -> dict:
        if not self.count:
            return {"probed_steps": 0}
        total = float(np.linalg.norm(self.sum_exact))
        cumulative = (float(np.linalg.norm(self.sum_reduced - self.sum_exact)) / total
                      if total > 0 else math.nan)
        return {"probed_steps": self.count, "step_rel_err": self.step_err / self.count,
                "cumulative_rel_err": cumulative}
