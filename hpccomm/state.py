"""What an :class:`~hpccomm.Allreducer` remembers about one tensor key."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np


@dataclass
class KeyState:
    """Per key: the step count, the memories' buffers and algorithm caches.

    ``residuals`` holds what the error-feedback memory (:mod:`hpccomm.memory`)
    carries from call to call, under named slots: ``"worker"`` before a rank's
    own encode, ``"owner"`` before an owner re-encodes its reduced chunk
    (two-shot algorithms), ``"momentum"`` for DGC's velocity,
    ``"powersgd:q"`` for PowerSGD's warm-start factors.  It is what
    :meth:`state_dict` saves."""

    step: int = 0
    #: the key's number of elements (a key names one tensor)
    n: Optional[int] = None
    residuals: Dict[str, np.ndarray] = field(default_factory=dict)
    #: per slot, the buffer the next ``v = g + e`` is written to (swapped with
    #: the residual when the memory is updated); not saved by state_dict
    spares: Dict[str, np.ndarray] = field(default_factory=dict)
    #: algorithm caches (e.g. routing tables; ``"device"``: the GPU that holds
    #: the key's device residuals); not saved by state_dict
    cache: Dict[str, object] = field(default_factory=dict)

    def state_dict(self, to_host: Optional[Callable[[object], np.ndarray]] = None) -> dict:
        """The step, ``n`` and copies of the residuals as host arrays;
        ``to_host(a)`` copies those kept in device memory."""
        return {"step": self.step, "n": self.n,
                "residuals": {k: v.copy() if isinstance(v, np.ndarray) else to_host(v)
                              for k, v in self.residuals.items()}}

    @classmethod
    def from_state_dict(cls, d: dict) -> "KeyState":
        res = {k: np.array(v, dtype=np.float32, copy=True) for k, v in d.get("residuals", {}).items()}
        n = d.get("n")
        return cls(step=int(d.get("step", 0)), n=None if n is None else int(n), residuals=res)
