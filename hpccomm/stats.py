"""Per-call and cumulative measurements of a collective.

Bytes are counted per rank at the MPI call boundary: what this rank handed to
MPI to send, and what it received.  For ``algorithm="mpi"`` MPI's internal
traffic cannot be observed, so the bandwidth-optimal figure
``2 (P-1)/P * nbytes`` that ring / Rabenseifner allreduces move is reported and
``modelled`` is set.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Tuple

PHASES = ("encode", "comm", "decode")


@dataclass
class CallStats:
    """What one call of a collective did on this rank."""

    key: str = ""
    n: int = 0
    nbytes: int = 0            #: size of the uncompressed input in bytes (float32)
    bytes_sent: int = 0
    bytes_recv: int = 0
    t_encode: float = 0.0
    t_comm: float = 0.0
    t_decode: float = 0.0
    t_total: float = 0.0
    modelled: bool = False     #: bytes are a model, not a count
    extra: dict = field(default_factory=dict)  #: algorithm-specific facts (e.g. went_dense)

    def time(self, phase: str) -> "_Timer":
        """``with call.time("encode"): ...`` adds the block's wall time to
        ``t_encode`` (a plain class: a dozen of these per call must cost
        nanoseconds, not the microseconds of a generator context manager)."""
        return _Timer(self, "t_" + phase)

    def sent(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)

    def received(self, nbytes: int) -> None:
        self.bytes_recv += int(nbytes)

    def as_dict(self) -> dict:
        return asdict(self)


class _Timer:
    __slots__ = ("call", "attr", "t0")

    def __init__(self, call: CallStats, attr: str):
        self.call, self.attr = call, attr

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        setattr(self.call, self.attr, getattr(self.call, self.attr) + time.perf_counter() - self.t0)
        return False


class Stats:
    """Cumulative :class:`CallStats` of an :class:`~hpccomm.Allreducer`.

    ``last`` is the last call's :class:`CallStats`.  A repeated call that
    only times an unchanging call (:meth:`record_repeat`) does not build one:
    ``last`` is made from its template when read."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.t_encode = 0.0
        self.t_comm = 0.0
        self.t_decode = 0.0
        self.t_total = 0.0
        self._last: CallStats = CallStats()
        self._repeat: Optional[Tuple[CallStats, float, float]] = None

    @property
    def last(self) -> CallStats:
        if self._repeat is not None:
            template, t_comm, t_total = self._repeat
            self._last = replace(template, t_comm=t_comm, t_total=t_total,
                                 extra=dict(template.extra))
            self._repeat = None
        return self._last

    def record(self, call: CallStats) -> None:
        self.calls += 1
        self.bytes_sent += call.bytes_sent
        self.bytes_recv += call.bytes_recv
        self.t_encode += call.t_encode
        self.t_comm += call.t_comm
        self.t_decode += call.t_decode
        self.t_total += call.t_total
        self._last, self._repeat = call, None

    def record_repeat(self, template: CallStats, t_comm: float, t_total: float) -> None:
        """Record a call that is ``template`` (its key, sizes and bytes; no
        encode or decode) with these times -- the reducer's repeated dense
        call, which thus builds no object per call."""
        self.calls += 1
        self.bytes_sent += template.bytes_sent
        self.bytes_recv += template.bytes_recv
        self.t_comm += t_comm
        self.t_total += t_total
        self._repeat = (template, t_comm, t_total)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "bytes_sent": self.bytes_sent, "bytes_recv": self.bytes_recv,
                "t_encode": self.t_encode, "t_comm": self.t_comm, "t_decode": self.t_decode,
                "t_total": self.t_total, "last": self.last.as_dict()}

    def __repr__(self) -> str:
        return (f"Stats(calls={self.calls}, sent={self.bytes_sent} B, recv={self.bytes_recv} B, "
                f"encode={self.t_encode:.4g}s, comm={self.t_comm:.4g}s, "
                f"decode={self.t_decode:.4g}s, total={self.t_total:.4g}s)")
