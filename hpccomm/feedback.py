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
        """Return ``v = g + e`` (a new array; ``g`` is never modified)."""
        if not self.enabled:
            return g
        e = state.residuals.get(slot)
        if e is None or e.size != g.size:
            return g.copy()
        return g + e

    def update(self, state: KeyState, slot: str, v: np.ndarray, decoded: np.ndarray) -> None:
        """Store ``e = v - decoded``."""
        if not self.enabled:
            return
        e = state.residuals.get(slot)
        if e is None or e.size != v.size:
            e = np.empty(v.size, dtype=np.float32)
            state.residuals[slot] = e
        np.subtract(v, decoded, out=e)

    def residual(self, state: KeyState, slot: str) -> Optional[np.ndarray]:
        return state.residuals.get(slot)
