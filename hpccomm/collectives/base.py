"""The algorithm protocol and registry.

An algorithm moves packets between ranks.  It is built once per
:class:`~hpccomm.Allreducer` from a communicator (for its rank and size) and a
codec, and then called as ``reduce(x, out, state, ctx)``:

* ``x`` -- this rank's contribution, a flat contiguous float32 (float64 for
  algorithms that list it in ``dtypes``) numpy array; it must not be modified;
* ``out`` -- where the **sum** over ranks goes (same size and dtype);
  ``op="mean"`` is applied by the caller, once, afterwards;
* ``state`` -- the key's :class:`~hpccomm.feedback.KeyState` (residuals, caches);
* ``ctx`` -- a :class:`~hpccomm.collectives.base.ReduceContext`: the call's
  :class:`~hpccomm.collectives.transport.Transport` (``ctx.net``, through which
  every MPI call goes; ``ctx.call`` is its
  :class:`~hpccomm.stats.CallStats`), error feedback, step and seed.

Every rank must produce the same bits in ``out``: sums are taken in a fixed
order and owners use their decoded results exactly as the other ranks do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, Tuple

import numpy as np
from mpi4py import MPI

from ..codecs.base import Codec, EncodeContext
from ..feedback import ErrorFeedback, KeyState
from ..registry import Registry
from ..stats import CallStats
from .transport import Transport


@dataclass
class ReduceContext:
    #: the call's MPI calls and their accounting
    net: Transport
    feedback: ErrorFeedback = field(default_factory=lambda: ErrorFeedback(False))
    seed: int = 0
    step: int = 0
    #: the user's tensor shape (per-column codecs take their column length from it)
    shape: tuple = ()

    @property
    def call(self) -> CallStats:
        return self.net.call

    def encode_context(self, rank: int, offset: int = 0) -> EncodeContext:
        return EncodeContext(seed=self.seed, rank=rank, step=self.step, offset=offset,
                             shape=self.shape)


def chunk_bounds(n: int, parts: int, align: int = 1) -> np.ndarray:
    """``parts + 1`` boundaries cutting ``[0, n)`` into ``parts`` contiguous
    chunks whose starts are multiples of ``align`` (the last chunk takes the
    ragged end).  Units of ``align`` elements are shared as evenly as possible,
    the first ``units % parts`` chunks taking one more -- the same on every rank
    for any ``n``, including ``n < parts`` (trailing chunks are then empty)."""
    align = max(1, int(align))
    units = -(-n // align)
    q, r = divmod(units, parts)
    starts = np.array([align * (j * q + min(j, r)) for j in range(parts + 1)], dtype=np.int64)
    return np.minimum(starts, n)


class Algorithm:
    name: ClassVar[str] = ""
    #: dtypes the algorithm reduces natively
    dtypes: ClassVar[Tuple[str, ...]] = ("float32",)
    #: can run on device buffers directly (GPU-aware MPI)
    supports_device: ClassVar[bool] = False

    def __init__(self, comm: MPI.Comm, codec: Codec, **options):
        if options:
            raise TypeError(f"algorithm {self.name!r} takes no options {sorted(options)}")
        self.codec = codec
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.check_codec(codec)

    def scratch(self, name: str, n: int, dtype=np.float32) -> np.ndarray:
        """A work buffer of ``n`` elements (contents undefined), one per name,
        kept between calls: large reductions then do not page-fault fresh
        memory on every call.  Valid until the next ``scratch(name, ...)``."""
        bufs = self.__dict__.setdefault("_scratch", {})
        buf = bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = bufs[name] = np.empty(n, dtype=dtype)
        return buf[:n]

    def check_codec(self, codec: Codec) -> None:
        """Raise ValueError if this algorithm cannot carry ``codec``."""

    def params(self) -> Dict[str, object]:
        return {}

    def describe(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in sorted(self.params().items()))
        return f"{self.name}({p})"

    def reduce(self, x: np.ndarray, out: np.ndarray, state: KeyState,
               ctx: ReduceContext) -> None:
        raise NotImplementedError

    def reduce_device(self, x, out, backend, state, ctx) -> None:  # pragma: no cover
        raise NotImplementedError


#: every algorithm, by name
ALGORITHMS = Registry("algorithm", not_options=("comm", "codec"))
register_algorithm = ALGORITHMS.register
available_algorithms = ALGORITHMS.names
get_algorithm_class = ALGORITHMS.get
