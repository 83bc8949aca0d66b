"""Error-feedback memories: what a worker carries from one call of a key to the next.

Every compressed allreduce brackets its exchange the same way (GRACE's
``send_step``: compensate -> compress -> update memory -> send)::

    v = memory.compensate(state, slot, g)      # e.g. v = g + e
    packet = encode(v)  ...  decoded = decode(packet)
    memory.update(state, slot, v, decoded)     # e.g. e = v - decoded

The bracket lives in one place, :class:`~hpccomm.collectives.base.Contribution`,
driven by :meth:`Algorithm.reduce <hpccomm.collectives.base.Algorithm.reduce>`;
algorithms implement only the exchange.  A memory is one of:

``none`` (:class:`NoMemory`)
    nothing is kept; ``v = g``.
``residual`` (:class:`ResidualMemory`)
    ``v = g + e``; ``e = v - decoded``.  The residual is taken against the
    *decoded* packet, never against a clip or threshold.
``dgc`` (:class:`DGCMemory`)
    Deep Gradient Compression's momentum correction and momentum factor
    masking (Lin et al., ICLR 2018): ``u = m u + g`` (Nesterov:
    ``u = m (u + g)``), ``v = e + u`` (Nesterov: ``e + u + g``), and once sent,
    ``e = v - decoded`` (zero where a sparsifier sent the exact value) and
    ``u = 0`` at the sent positions.  With ``codec="dgc"`` this is DGC's
    worker side without hand wiring; the optimizer then applies no momentum
    of its own.  (Warm-up and clipping across tensors stay optimizer-side:
    :class:`hpccomm.dgc_optimizer.DGCMomentum`.)

Owners of two-shot algorithms re-encode reduced chunks; their ``"owner"``
slot always keeps a plain residual (:attr:`Memory.owner`), whatever the
worker's memory.

Buffers live in the key's :class:`~hpccomm.state.KeyState`: ``v`` is written
into a spare the state owns and becomes the residual at the update (the old
residual becomes the next spare), so a call allocates nothing after the first
and an error between compensate and update loses nothing.
"""
from __future__ import annotations

from typing import ClassVar, Dict, Optional

import numpy as np

from .registry import Registry
from .state import KeyState

#: every memory, by name
MEMORIES = Registry("memory")
register_memory = MEMORIES.register
available_memories = MEMORIES.names


class Memory:
    """The protocol; :class:`NoMemory` is its trivial implementation."""

    name: ClassVar[str] = ""
    #: keeps anything between calls (``update`` is not a no-op)
    enabled: ClassVar[bool] = False
    #: the memory is exactly ``v = g + e; e = v - decoded`` on the slot
    #: ``"worker"``, so a codec's ``encode_with_feedback`` may do the whole
    #: bracket in one pass over ``g`` and ``e``
    fusable: ClassVar[bool] = False

    def compensate(self, state: KeyState, slot: str, g: np.ndarray) -> np.ndarray:
        """Return the vector to encode (``g`` is never modified)."""
        return g

    def fresh(self, state: KeyState, slot: str, g: np.ndarray) -> np.ndarray:
        """The part of ``v`` that is new this call (after :meth:`compensate`):
        ``g`` itself by default.  Codecs whose parameter scales with the input
        (threshold's ``alpha``) take the scale from it rather than from ``v``,
        whose carried residual grows as long as it is not sent."""
        return g

    def update(self, state: KeyState, slot: str, v: np.ndarray, decoded: np.ndarray) -> None:
        """``v`` (from :meth:`compensate`) went out as ``decoded``."""

    def update_sparse(self, state: KeyState, slot: str, v: np.ndarray, idx: np.ndarray,
                      vals: np.ndarray) -> None:
        """``v`` went out as the pairs ``(idx, vals)`` (``idx`` strictly increasing)."""

    def fused_buffers(self, state: KeyState, slot: str, n: int, empty=None):
        """For fused codecs (``fusable`` memories): ``(e, e_out)``, the slot's
        residual of ``n`` elements (None before the first update) and the
        buffer the new one is written to; :meth:`commit_fused` makes ``e_out``
        the residual.  Until then the old residual is untouched.  ``empty(n)``
        allocates float32 buffers (default numpy; the device path passes its
        device allocator and keeps its residuals in slots of their own)."""
        raise NotImplementedError(f"memory {self.name!r} is not fusable")

    def commit_fused(self, state: KeyState, slot: str) -> None:
        raise NotImplementedError(f"memory {self.name!r} is not fusable")

    @property
    def owner(self) -> "Memory":
        """The memory of an owner's re-encode: a plain residual when this one keeps anything."""
        return RESIDUAL if self.enabled else NONE

    def params(self) -> Dict[str, object]:
        return {}

    def describe(self) -> str:
        """How the memory appears in ``Allreducer.describe()`` (``True``/``False``
        for residual/none, as before memories had names)."""
        p = ",".join(f"{k}={v}" for k, v in sorted(self.params().items()))
        return f"{self.name}({p})"


@register_memory
class NoMemory(Memory):
    name = "none"

    def describe(self) -> str:
        return "False"


@register_memory
class ResidualMemory(Memory):
    name = "residual"
    enabled = True
    fusable = True

    def describe(self) -> str:
        return "True"

    def compensate(self, state, slot, g):
        """``v = g + e``, written into a buffer the state owns (allocated on
        the first call of a key, reused after: a fresh 64 MiB array costs page
        faults on every call).  Until :meth:`update` the old residual is
        untouched."""
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

    def _commit(self, state, slot, v) -> Optional[np.ndarray]:
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

    def update(self, state, slot, v, decoded):
        """``e = v - decoded`` (in place when ``v`` came from :meth:`compensate`)."""
        flat = self._commit(state, slot, v)
        if flat is not None:
            np.subtract(flat, decoded.reshape(-1), out=flat)
            return
        e = state.residuals.get(slot)
        if e is None or e.size != v.size:
            e = np.empty(v.size, dtype=np.float32)
            state.residuals[slot] = e
        np.subtract(v.reshape(-1), decoded.reshape(-1), out=e)

    def update_sparse(self, state, slot, v, idx, vals):
        """``e = v - densify(idx, vals)``: ``v`` everywhere, ``v[i] - vals`` at
        the sent entries (the same bits as the dense subtraction:
        ``v - 0.0 == v``)."""
        flat = self._commit(state, slot, v)
        if flat is None:
            flat = np.array(v, dtype=np.float32, copy=True).reshape(-1)
            state.residuals[slot] = flat
        flat[idx] -= vals

    def fused_buffers(self, state, slot, n, empty=None):
        e = state.residuals.get(slot)
        if e is not None and e.size != n:
            e = None
        spare = state.spares.get(slot)
        if spare is None or spare.size != n:
            spare = state.spares[slot] = (empty(n) if empty is not None
                                          else np.empty(n, dtype=np.float32))
        return e, spare

    def commit_fused(self, state, slot):
        spare = state.spares.pop(slot)
        old = state.residuals.get(slot)
        state.residuals[slot] = spare
        if old is not None and old.size == spare.size:
            state.spares[slot] = old


NONE = NoMemory()
RESIDUAL = ResidualMemory()


@register_memory
class DGCMemory(Memory):
    """DGC's momentum correction and factor masking (see the module docstring).

    ``momentum`` is the optimizer's ``m`` (0.9 in DGC); ``masking=False``
    keeps ``u`` where entries were sent."""

    name = "dgc"
    enabled = True

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, masking: bool = True):
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), not {momentum!r}")
        self.momentum = np.float32(momentum)
        self.nesterov = bool(nesterov)
        self.masking = bool(masking)

    def params(self):
        return {"momentum": float(self.momentum), "nesterov": self.nesterov,
                "masking": self.masking}

    def compensate(self, state, slot, g):
        u = state.residuals.get("momentum")
        if u is None or u.size != g.size:
            u = state.residuals["momentum"] = np.zeros(g.size, dtype=np.float32)
        flat = g.reshape(-1)
        if self.nesterov:
            u += flat
            u *= self.momentum
        else:
            u *= self.momentum
            u += flat
        v = RESIDUAL.compensate(state, slot, u.reshape(g.shape))   # e + u
        if self.nesterov:
            v += g                                                   # (e + u) + g
        return v

    def fresh(self, state, slot, g):
        """The momentum-corrected gradient ``u`` (Nesterov: ``u + g``), what
        ``v`` adds to the residual this call."""
        u = state.residuals["momentum"].reshape(g.shape)
        return u + g if self.nesterov else u

    def update(self, state, slot, v, decoded):
        RESIDUAL.update(state, slot, v, decoded)
        if self.masking:
            state.residuals["momentum"][decoded.reshape(-1) != 0] = 0

    def update_sparse(self, state, slot, v, idx, vals):
        RESIDUAL.update_sparse(state, slot, v, idx, vals)
        if self.masking:
            state.residuals["momentum"][idx] = 0


def get_memory(spec, biased: bool = True) -> Memory:
    """A memory from ``error_feedback``'s forms: a :class:`Memory`, a name
    (``"none"``, ``"residual"``, ``"dgc"``), ``True`` (residual), ``False``
    (none), or ``None`` (residual for a ``biased`` codec, else none)."""
    if isinstance(spec, Memory):
        return spec
    if spec is None:
        spec = bool(biased)
    if isinstance(spec, (bool, np.bool_)):
        return RESIDUAL if spec else NONE
    if isinstance(spec, str):
        return MEMORIES.get(spec)()
    raise TypeError(f"error_feedback must be None, a bool, a memory name "
                    f"({', '.join(available_memories())}) or a hpccomm.memory.Memory, "
                    f"not {type(spec).__name__}")
