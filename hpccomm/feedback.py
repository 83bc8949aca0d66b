"""Error feedback: residual memory per tensor key.

``v = g + e;  p = encode(v);  e = v - decode(p)``.  The residual is taken
against the *decoded* packet, never against a clip or threshold.  Residuals
live in :class:`KeyState` objects owned by an :class:`~hpccomm.Allreducer`, one
per key, under named slots: ``"worker"`` before a rank's own encode and
``"owner"`` before an owner re-encodes its reduced chunk (two-shot algorithms).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np


@dataclass
class KeyState:
    """Everything an Allreducer remembers about one key."""

    step: int = 0
    description: Optional[str] = None
    residuals: Dict[str, np.ndarray] = field(default_factory=dict)
    #: per slot, the buffer the next ``v = g + e`` is written to (swapped with
    #: the residual by :meth:`ErrorFeedback.update`); not saved by state_dict
    spares: Dict[str, np.ndarray] = field(default_factory=dict)
    #: algorithm caches (e.g. routing tables); not saved by state_dict
    cache: Dict[str, object] = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": self.step, "residuals": {k: v.copy() for k, v in self.residuals.items()}}

    @classmethod
    def from_state_dict(cls, d: dict) -> "KeyState":
        res = {k: np.array(v, dtype=np.float32, copy=True) for k, v in d.get("residuals", {}).items()}
        return cls(step=int(d.get("step", 0)), residuals=res)


class ErrorFeedback:
    """Residual bookkeeping; ``enabled=False`` turns both calls into no-ops."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)

    def compensate(self, state: KeyState, slot: str, g: np.ndarray) -> np.ndarray:
        """Return ``v = g + e`` (``g`` is never modified).

        ``v`` is written into a buffer the state owns (allocated on the first
        call of a key, reused after: a fresh 64 MiB array costs page faults on
        every call).  Pass it back to :meth:`update` / :meth:`update_sparse`,
        which turn it into the new residual in place; until then the old
        residual is untouched, so an error between the two calls loses
        nothing."""
        if not self.enabled:
            return g
        e = state.residuals.get(slot)
        v = state.spares.get(slot)
        if v is None or v.size != g.size:
            v = state.spares[slot] = np.empty(g.size, dtype=np.float32)
        v = v.reshape(g.shape)
        if e is None or e.size != g.size:
            np.copyto(v, g)
        else:
            np.add(g, e.reshape(g.shape), out=v)
        return v

    def _commit(self, state: KeyState, slot: str, v: np.ndarray) -> Optional[np.ndarray]:
        """The flat buffer behind ``v`` if it is ``slot``'s spare (then it becomes
        the residual and the old residual the spare), else None."""
        spare = state.spares.get(slot)
        if spare is None or not np.may_share_memory(v, spare) or v.size != spare.size:
            return None
        old = state.residuals.get(slot)
        state.residuals[slot] = spare
        if old is not None and old.size == spare.size:
            state.spares[slot] = old
        else:
            del state.spares[slot]
        return spare

    def update(self, state: KeyState, slot: str, v: np.ndarray, decoded: np.ndarray) -> None:
        """Store ``e = v - decoded`` (in place when ``v`` came from :meth:`compensate`)."""
        if not self.enabled:
            return
        flat = self._commit(state, slot, v)
        if flat is not None:
            np.subtract(flat, decoded.reshape(-1), out=flat)
            return
        e = state.residuals.get(slot)
        if e is None or e.size != v.size:
            e = np.empty(v.size, dtype=np.float32)
            state.residuals[slot] = e
        np.subtract(v.reshape(-1), decoded.reshape(-1), out=e)

    def update_sparse(self, state: KeyState, slot: str, v: np.ndarray, idx: np.ndarray,
                      vals: np.ndarray) -> None:
        """Store ``e = v - densify(idx, vals)`` for strictly increasing ``idx``:
        ``v`` everywhere, ``v[i] - vals`` at the sent entries (the same bits as
        the dense subtraction: ``v - 0.0 == v``)."""
        if not self.enabled:
            return
        flat = self._commit(state, slot, v)
        if flat is None:
            flat = np.array(v, dtype=np.float32, copy=True).reshape(-1)
            state.residuals[slot] = flat
        flat[idx] -= vals

    def residual(self, state: KeyState, slot: str) -> Optional[np.ndarray]:
        return state.residuals.get(slot)
