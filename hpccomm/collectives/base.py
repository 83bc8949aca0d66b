"""The algorithm protocol and registry.

An algorithm moves packets between ranks.  It is built once per
:class:`~hpccomm.Allreducer` from a communicator (for its rank and size) and a
codec, and then called as ``reduce(x, out, state, ctx)``, a template that
owns error feedback (GRACE's ``send_step``)::

    work = Contribution(...)               # v = x + e  (the memory's compensate)
    self.exchange(work, out, state, ctx)   # encode through work, move, decode into out
    work.commit()                          # e = v - decode(own packets)  (its update)

Subclasses implement :meth:`Algorithm.exchange` only; they encode this
rank's data through the :class:`Contribution` (``work.encode_chunks(bounds,
ctx, rank)``, or ``work.v`` for algorithms that read the compensated vector
otherwise, then say what it decoded to with ``work.decoded`` /
``work.sent_pairs``).  A codec with ``encode_with_feedback`` then does
compensate, encode and the residual in one pass, counting NaN/Inf on the
way; the reducer then defers its cross-rank check (``ctx.agree``) until that
encode is done instead of reading the input once more to look for them.
Arguments:

* ``x`` -- this rank's contribution, a flat contiguous float32 (float64 for
  algorithms that list it in ``dtypes``) numpy array; it must not be modified;
* ``out`` -- where the **sum** over ranks goes (same size and dtype);
  ``op="mean"`` is applied by the caller, once, afterwards;
* ``state`` -- the key's :class:`~hpccomm.state.KeyState` (residuals, caches);
* ``ctx`` -- a :class:`~hpccomm.collectives.base.ReduceContext`: the call's
  :class:`~hpccomm.collectives.transport.Transport` (``ctx.net``, through which
  every MPI call goes; ``ctx.call`` is its
  :class:`~hpccomm.stats.CallStats`), the error-feedback memory, step and seed.

Every rank must produce the same bits in ``out``: sums are taken in a fixed
order and owners use their decoded results exactly as the other ranks do.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..codecs.base import Codec, EncodeContext
from ..errors import NonFiniteError, nonfinite_input
from ..kernels.nonfinite import count_nonfinite
from ..memory import NONE, Memory
from ..registry import Registry
from ..state import KeyState
from ..stats import CallStats
from .transport import Transport


@dataclass
class ReduceContext:
    #: the call's MPI calls and their accounting
    net: Transport
    #: the error-feedback memory of the worker side
    memory: Memory = field(default=NONE)
    seed: int = 0
    step: int = 0
    #: the user's tensor shape (per-column codecs take their column length from it)
    shape: tuple = ()
    #: the shapes of the tensors fused into the flat input, in order (the
    #: caller's ``layout``; None: the input is one tensor of ``shape``)
    layout: Optional[tuple] = None
    #: the call's key (None: a call without state)
    key: Optional[str] = None
    #: let codecs fuse error feedback into their encode (False: the reference path)
    fused: bool = True
    #: the reducer has checked that ``x`` is finite (its collective scan)
    finite: bool = False
    #: the call's cross-rank check, deferred past the local encode (the fused
    #: kernels count NaN/Inf on their pass): ``agree(error_or_None)``, run once
    #: by :meth:`Contribution.encode_chunks` before anything is sent; None when
    #: the reducer ran it already
    agree: Optional[Callable[[Optional[BaseException]], None]] = None
    #: device input: its GPU and the stream that produced it (a
    #: :class:`~hpccomm.buffers.Placement`); None for host input
    where: Optional[tuple] = None

    @property
    def call(self) -> CallStats:
        return self.net.call

    def encode_context(self, rank: int, offset: int = 0) -> EncodeContext:
        """The context of an encode as ``rank`` at ``offset``; ``feedback``
        when the call keeps a memory (the worker's, and then the owner's)."""
        return EncodeContext(seed=self.seed, rank=rank, step=self.step, offset=offset,
                             shape=self.shape, feedback=self.memory.enabled)


def chunk_bounds(n: int, parts: int, align: int = 1) -> np.ndarray:
    """``parts + 1`` boundaries cutting ``[0, n)`` into ``parts`` contiguous
    chunks whose starts are multiples of ``align``.  The ``n // align`` whole
    units are shared as evenly as possible, the first ``units % parts``
    chunks taking one more, and the ragged end (``n % align`` elements) goes
    to the last chunk, which then never has more than a unit above the
    others: every chunk is within one unit of ``n / parts``.  The same on
    every rank for any ``n``, including ``n < parts`` (trailing chunks are
    then empty) and ``n < align`` (the last chunk takes all)."""
    align = max(1, int(align))
    units, _ = divmod(n, align)
    q, r = divmod(units, parts)
    starts = np.array([align * (j * q + min(j, r)) for j in range(parts)] + [n], dtype=np.int64)
    return starts


def input_error(exc: Exception, x: np.ndarray, codec_name: str) -> Exception:
    """What a call raises on every rank for ``exc``, raised by an encode of
    (part of) ``x``: the reducer's own error for NaN/Inf in ``x``, counted
    over the whole input (the kernel stopped at its chunk), else ``exc``."""
    if isinstance(exc, NonFiniteError) and (bad := count_nonfinite(x)):
        return nonfinite_input(bad, codec_name)
    return exc


class Contribution:
    """This rank's compensated vector during one call: the worker side of
    error feedback, in one place (see the module docstring).

    ``encode(lo, hi, ectx)`` encodes ``v[lo:hi]``; every encoded range must be
    settled before :meth:`commit` -- by default commit decodes the packets
    itself, or the algorithm hands over what they decoded to
    (:meth:`decoded`: it decoded them anyway).  Algorithms that do not send
    codec packets read :attr:`v` and settle with :meth:`decoded` (summable
    codes) or :meth:`sent_pairs` (sparse pairs).

    With a fusable memory (the plain residual) and a codec that has
    ``encode_with_feedback(x, e, e_out, ectx) -> packet`` -- which reads ``x``
    and ``e`` (None: no residual yet, ``v = x``) and writes the packet of
    ``v = x + e`` and ``e_out = v - decode(packet)``, with the bits of the
    three-step form -- ``encode`` makes one pass and commit only swaps
    ``e_out`` in as the residual (an error before it leaves the old one).  The
    algorithm opts in with ``fuses_feedback`` (it touches the vector only
    through ``encode``); ``fuse=False`` forces the three-step reference."""

    def __init__(self, codec: Codec, memory: Memory, state: KeyState, x: np.ndarray,
                 scratch, fuse: bool, finite: bool = False):
        self.codec, self.memory, self.state, self.x = codec, memory, state, x
        self._scratch = scratch
        self._fused = (fuse and memory.fusable
                       and getattr(codec, "encode_with_feedback", None) is not None)
        if self._fused:
            self._e, self._e_out = memory.fused_buffers(state, "worker", x.size)
            self._v = None
            self._fresh = None
        else:
            self._v = memory.compensate(state, "worker", x)
            self._fresh = memory.fresh(state, "worker", x) if memory.enabled else None
        #: ``v`` is the input the reducer found finite: codecs skip their scan
        self._finite = finite and self._v is x
        self._pending = []          # (lo, hi, packet) not yet settled
        self._own: Optional[np.ndarray] = None
        self._pairs = None

    @property
    def v(self) -> np.ndarray:
        """The compensated vector ``x + e`` (the memory's compensate)."""
        if self._v is None:
            raise RuntimeError("fused error feedback: the compensated vector is never formed")
        return self._v

    def context(self, ectx: EncodeContext, lo: int = 0,
                hi: Optional[int] = None) -> EncodeContext:
        """``ectx`` for an encode of ``v[lo:hi]`` (the reference path): with
        ``fresh``, the memory's fresh part of it (:meth:`Memory.fresh
        <hpccomm.memory.Memory.fresh>`), and ``finite`` when ``v`` is the
        input the reducer found finite."""
        if self._fresh is not None:
            ectx = replace(ectx, fresh=self._fresh[lo:hi])
        if self._finite:
            ectx = replace(ectx, finite=True)
        return ectx

    def encode(self, lo: int, hi: int, ectx: EncodeContext) -> np.ndarray:
        """The packet of ``v[lo:hi]``."""
        if self._fused:     # the fresh part is x itself
            e = None if self._e is None else self._e[lo:hi]
            return self.codec.encode_with_feedback(self.x[lo:hi], e, self._e_out[lo:hi], ectx)
        packet = self.codec.encode(self._v[lo:hi], self.context(ectx, lo, hi))
        if self.memory.enabled:
            self._pending.append((lo, hi, packet))
        return packet

    def chunk_stat(self, lo: int, hi: int, ectx: EncodeContext):
        """The statistic of the chunk ``v[lo:hi]`` that its pieces are encoded
        against (codecs with ``chunk_statistic``: :meth:`encode_piece`)."""
        if self._fused:
            return self.codec.chunk_stat(self.x[lo:hi],
                                         None if self._e is None else self._e[lo:hi], ectx)
        return self.codec.chunk_stat(self._v[lo:hi], None, self.context(ectx, lo, hi))

    def encode_piece(self, lo: int, hi: int, stat, ectx: EncodeContext) -> np.ndarray:
        """The packet of the piece ``v[lo:hi]`` of a chunk whose statistic is
        ``stat`` (:meth:`chunk_stat`; ``ectx.offset`` is ``lo``): with the bits
        of the chunk's own encode over those elements."""
        if self._fused:
            e = None if self._e is None else self._e[lo:hi]
            return self.codec.encode_piece(self.x[lo:hi], e, self._e_out[lo:hi], stat, ectx)
        packet = self.codec.encode_piece(self._v[lo:hi], None, None, stat,
                                         self.context(ectx, lo, hi))
        if self.memory.enabled:
            self._pending.append((lo, hi, packet))
        return packet

    def encode_chunks(self, bounds: Sequence[int], ctx: ReduceContext,
                      rank: int) -> List[np.ndarray]:
        """The packets of ``v[bounds[j]:bounds[j + 1]]`` for every ``j``
        (chunk ``j`` with ``offset = bounds[j]``, as ``rank``); then the
        call's deferred cross-rank check (``ctx.agree``), so that an error
        of this rank's encode -- a NaN/Inf its fused kernel counted -- is
        raised on every rank before anything is sent."""
        try:
            packets = [self.encode(lo, hi, ctx.encode_context(rank, lo))
                       for lo, hi in zip(bounds[:-1], bounds[1:])]
        except Exception as exc:
            if ctx.agree is None:
                raise
            ctx.agree(input_error(exc, self.x, self.codec.name))
            raise  # pragma: no cover (agree raised)
        if ctx.agree is not None:
            ctx.agree(None)
        return packets

    def _own_buffer(self) -> np.ndarray:
        if self._own is None:
            self._own = self._scratch("own", self.x.size)
        return self._own

    def decoded(self, lo: int, hi: int, values: np.ndarray) -> None:
        """``v[lo:hi]`` went out as ``values`` (what its packet decodes to)."""
        if not self.memory.enabled or self._fused:
            return
        self._pending = [p for p in self._pending if not (p[0] == lo and p[1] == hi)]
        if lo == 0 and hi == self.x.size:
            self._own = values
        else:
            self._own_buffer()[lo:hi] = values

    def sent_pairs(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """``v`` went out as the sparse pairs ``(idx, vals)``."""
        self._pairs = (idx, vals)

    def commit(self, call: CallStats) -> None:
        """Update the memory with what went out (decoding unsettled packets)."""
        if self._fused:
            self.memory.commit_fused(self.state, "worker")
            return
        if not self.memory.enabled:
            return
        if self._pairs is not None:
            self.memory.update_sparse(self.state, "worker", self._v, *self._pairs)
            return
        if self._pending:
            own = self._own_buffer()
            with call.time("decode"):
                for lo, hi, packet in self._pending:
                    self.codec.decode(packet, own[lo:hi])
            self._pending = []
        if self._own is None:
            raise RuntimeError("error feedback: nothing was encoded or settled")
        self.memory.update(self.state, "worker", self._v, self._own)


class Algorithm:
    name: ClassVar[str] = ""
    #: dtypes the algorithm reduces natively
    dtypes: ClassVar[Tuple[str, ...]] = ("float32",)
    #: can run on device buffers directly (GPU-aware MPI)
    supports_device: ClassVar[bool] = False
    #: touches the compensated vector only through
    #: ``Contribution.encode_chunks``, once per call and before any transfer
    #: (so a codec's ``encode_with_feedback`` may fuse the bracket, and the
    #: call's cross-rank check may wait for its NaN/Inf count)
    fuses_feedback: ClassVar[bool] = False
    #: encodes sums of several ranks' inputs (hierarchical's node sums): a
    #: codec's range check (``check_values``) then allows for ``P`` terms
    encodes_sums: ClassVar[bool] = False

    def __init__(self, comm: MPI.Comm, codec: Codec, **options):
        if options:
            raise TypeError(f"algorithm {self.name!r} takes no options {sorted(options)}")
        self.codec = codec
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if codec.algorithm is not None and codec.algorithm != self.name:
            raise ValueError(f"codec {codec.name!r} is reduced by algorithm {codec.algorithm!r} "
                             f"only, not {self.name!r} (leave the algorithm out: it is picked "
                             f"by the codec)")
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

    def checks_after_encode(self, n: int, shape: tuple) -> bool:
        """Whether a call of ``n`` elements encodes all of this rank's data
        through :meth:`Contribution.encode_chunks` before its first transfer,
        so that the reducer may defer its cross-rank check to it
        (``ctx.agree``): the ``fuses_feedback`` algorithms, unless they
        pipeline the call."""
        return self.fuses_feedback

    def sends_dense(self, n: int, shape: tuple, key: Optional[str]) -> bool:
        """Whether a call of ``n`` elements of ``shape`` under ``key`` is one
        plain ``MPI_Allreduce`` (sum) of the input and nothing else -- no
        state, no random numbers -- so that the reducer may repeat it for the
        same key without entering the algorithm (its lean path)."""
        return False

    def check_codec(self, codec: Codec) -> None:
        """Raise ValueError if this algorithm cannot carry ``codec``."""

    def check_memory(self, memory: Memory) -> None:
        """Raise ValueError if this algorithm cannot carry the codec with
        ``memory`` (the reducer asks once it has chosen the memory)."""

    def params(self) -> Dict[str, object]:
        return {}

    def describe(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in sorted(self.params().items()))
        return f"{self.name}({p})"

    def reduce(self, x: np.ndarray, out: np.ndarray, state: KeyState,
               ctx: ReduceContext) -> None:
        """Error feedback around :meth:`exchange` (see the module docstring)."""
        work = Contribution(self.codec, ctx.memory, state, x, self.scratch,
                            self.fuses_feedback and ctx.fused, ctx.finite)
        self.exchange(work, out, state, ctx)
        work.commit(ctx.call)

    def repeat_plan(self, comm: MPI.Comm, n: int, shape: tuple, state: KeyState,
                    memory: Memory, deferred: bool) -> Optional["RepeatPlan"]:
        """A plan for this key's next calls of ``n`` elements of ``shape`` on
        ``comm`` (host float32, fused kernels; ``deferred``: the reducer's
        cross-rank check waits for the local encode), made after a call ran the
        general path: a :class:`RepeatPlan` whose ``reduce`` takes the very
        steps, collectives and bits of that path with what does not change
        from call to call made once.  None (the default): every call takes
        the general path."""
        return None

    def exchange(self, work: Contribution, out: np.ndarray, state: KeyState,
                 ctx: ReduceContext) -> None:
        """Write the sum over ranks of the contributions into ``out``; encode
        this rank's through ``work`` and settle it (see :class:`Contribution`)."""
        raise NotImplementedError

    def reduce_device(self, x, out, backend, state, ctx) -> None:  # pragma: no cover
        raise NotImplementedError


class RepeatPlan:
    """What an algorithm keeps for one key's repeated calls (see
    :meth:`Algorithm.repeat_plan`)."""

    #: what :meth:`hpccomm.Allreducer.repeat_path` reports for it
    kind = "plan"

    def reduce(self, x: np.ndarray, out: np.ndarray, state: KeyState, call: CallStats,
               seed: int, shape: tuple, memory: Memory, finite: bool,
               agree: Optional[Callable[[Optional[BaseException]], None]]) -> None:
        """:meth:`Algorithm.reduce` of step ``state.step`` (``finite``: the
        reducer scanned ``x``; its check deferred into ``agree``, or none),
        accounted in ``call``."""
        raise NotImplementedError


#: every algorithm, by name
ALGORITHMS = Registry("algorithm", not_options=("comm", "codec"))
register_algorithm = ALGORITHMS.register
available_algorithms = ALGORITHMS.names
get_algorithm_class = ALGORITHMS.get
