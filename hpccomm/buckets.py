"""Fusion buckets: the plan and the runner shared by the numpy
(:class:`hpccomm.fusion.GradientBuckets`) and PyTorch
(:class:`hpccomm.torch_grads.GradReducer`) front ends.

A model's gradients are dozens of arrays of very different sizes.  Reducing
each on its own pays the per-call latency dozens of times; reducing them
fused into a few flat buckets (Horovod's tensor fusion, DDP's buckets) pays it
once per bucket.  :func:`plan_buckets` plans the buckets once from the
tensors' names and shapes; a :class:`BucketRunner` holds the plan and the two
reducers and reduces each bucket's flat storage with one call.  The front
ends differ only in that storage: numpy copies the gradients in and out,
PyTorch makes every ``.grad`` a view of its bucket.

Layer filters (as in DGC and CGX): tensors that are small (fewer than
``min_compress`` elements) or one-dimensional (biases, norms), and any name
listed in ``dense``, go to the *dense* reducer (plain ``MPI_Allreduce`` by
default) -- compressing them saves nothing and hurts accuracy most.

Compressed buckets are reduced with their layout (the shapes of their
tensors, in order: what per-tensor algorithms such as ``powersgd`` need).
Keys are stable across steps (``"<prefix>/<kind><bucket index>"``) so that
error feedback follows each bucket.  ``bucket_bytes=0`` reduces every
compressed tensor on its own with its own shape (for per-column codecs such
as ``onebit``, whose columns come from the tensor's last axis).

Bounded staleness (``staleness=s``, both front ends): step ``t`` delivers the
reduced gradient of step ``t - s`` -- the allreduce counterpart of a
stale-synchronous parameter server (Petuum's SSP), and with ``s = 1`` the
one-step-delayed gradient of pipeline training.  Each step copies nothing
extra: the runner keeps ``s + 1`` sets of bucket storage (*slots*); step
``t`` fills slot ``t mod (s+1)`` and starts its buckets (non-blocking,
:mod:`hpccomm.requests`), then waits for the oldest step in flight once more
than ``s`` are, and hands its slot -- the one step ``t + 1`` fills next --
to the caller.  The first ``s`` steps deliver nothing (zeros, and
:attr:`BucketRunner.delivered` is False: skip the optimizer step).  Every rank
runs the same steps in the same order, so the ranks stay in lockstep by
construction: the same delayed gradient everywhere, bit for bit, and -- as the
progress thread runs started calls in start order -- error feedback sees the
steps in the order the synchronous path does: step ``t``'s delayed result
equals the synchronous result of step ``t - s`` bit for bit.  ``s = 0`` is
the synchronous path itself, unchanged.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .core import Allreducer
from .requests import Request


@dataclass
class Bucket:
    key: str
    names: List[str]
    offsets: List[int]
    sizes: List[int]
    shapes: List[tuple]
    dense: bool
    #: reduce with this shape (single-tensor buckets keep the tensor's shape)
    shape: tuple = ()
    #: flat float32 storage (allocated by the user of the plan)
    buffer: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return sum(self.sizes)


def plan_buckets(shapes: Mapping[str, Sequence[int]], *, bucket_bytes: int = 25 << 20,
                 min_compress: int = 1024, dense: Iterable[str] = (), compress_1d: bool = False,
                 prefix: str = "grads") -> List[Bucket]:
    """Group named tensors into compressed and dense buckets (see the module
    docstring); the same names and shapes give the same plan on every rank."""
    shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
    dense = set(dense)
    unknown = dense - set(shapes)
    if unknown:
        raise KeyError(f"dense names not among the gradients: {sorted(unknown)}")
    if bucket_bytes < 0:
        raise ValueError("bucket_bytes must be >= 0")
    groups: Dict[bool, List[str]] = {True: [], False: []}
    for name, shape in shapes.items():
        size = int(np.prod(shape)) if shape else 1
        groups[name in dense or size < min_compress or (len(shape) <= 1 and not compress_1d)
               ].append(name)
    buckets: List[Bucket] = []

    def numel(name):
        return int(np.prod(shapes[name])) if shapes[name] else 1

    def close(names, is_dense):
        sizes = [numel(n) for n in names]
        offsets = [int(o) for o in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
        shape = shapes[names[0]] if len(names) == 1 else (sum(sizes),)
        kind = "dense" if is_dense else "bucket"
        buckets.append(Bucket(key=f"{prefix}/{kind}{len(buckets)}", names=list(names),
                              offsets=offsets, sizes=sizes, shapes=[shapes[n] for n in names],
                              dense=is_dense, shape=shape))

    # dense tensors are always fused: their shapes do not matter to MPI_Allreduce
    for is_dense, limit in ((False, bucket_bytes), (True, bucket_bytes or (25 << 20))):
        current, current_bytes = [], 0
        for name in groups[is_dense]:
            nbytes = 4 * numel(name)
            if current and (limit == 0 or current_bytes + nbytes > limit):
                close(current, is_dense)
                current, current_bytes = [], 0
            current.append(name)
            current_bytes += nbytes
        if current:
            close(current, is_dense)
    return buckets


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request, then raise the first error (raised on every
    rank alike), so that no request of a step is left running."""
    error = None
    for req in requests:
        try:
            req.wait()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def check_staleness(staleness) -> int:
    if isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer)) \
            or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, not {staleness!r}")
    return int(staleness)


class BucketRunner:
    """The plan of ``shapes`` and the two reducers that carry it.

    ``dense_reducer`` defaults to ``codec="none", algorithm="mpi"`` on the
    compressed reducer's communicator with its op; the two must share the op.
    ``staleness`` is the bound of the module docstring (0: synchronous).
    The remaining keywords are :func:`plan_buckets`'s."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], reducer: Allreducer,
                 dense_reducer: Optional[Allreducer] = None, *, staleness: int = 0,
                 **plan_options):
        self.staleness = check_staleness(staleness)
        #: steps started so far, and those in flight: (slot, requests), oldest first
        self.steps = 0
        self._in_flight: Deque[Tuple[int, List[Request]]] = collections.deque()
        #: whether the last step delivered a reduced gradient (False only in the
        #: first ``staleness`` steps)
        self.delivered = True
        self.reducer = reducer
        self.dense_reducer = dense_reducer or Allreducer(reducer.parent, codec="none",
                                                         algorithm="mpi", op=reducer.op,
                                                         on_error=reducer.on_error)
        if self.dense_reducer.op != reducer.op:
            raise ValueError("reducer and dense_reducer must use the same op")
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.buckets = plan_buckets(self.shapes, **plan_options)

    def run(self, flats: Sequence[Any], before: Optional[Callable[[Bucket, Any], None]] = None,
            after: Optional[Callable[[Bucket, Any], None]] = None) -> None:
        """Reduce each bucket's flat storage ``flats[i]`` in place, one call
        per bucket in plan order; ``before`` / ``after`` fill and drain it."""
        for b, flat in zip(self.buckets, flats):
            if before is not None:
                before(b, flat)
            target = flat.reshape(b.shape)
            if b.dense:
                self.dense_reducer(target, key=b.key, out=target)
            else:
                self.reducer(target, key=b.key, out=target, layout=b.shapes)
            if after is not None:
                after(b, flat)

    def start_bucket(self, index: int, flat: Any) -> Request:
        """Start reducing bucket ``index``'s flat storage in place (non-blocking,
        :meth:`hpccomm.Allreducer.start`); the request's result is ``run``'s."""
        b = self.buckets[index]
        target = flat.reshape(b.shape)
        if b.dense:
            return self.dense_reducer.start(target, key=b.key, out=target)
        return self.reducer.start(target, key=b.key, out=target, layout=b.shapes)

    # ------------------------------------------------------------ staleness
    @property
    def slots(self) -> int:
        """Sets of bucket storage: ``staleness + 1``."""
        return self.staleness + 1

    @property
    def in_flight(self) -> int:
        """Steps started whose reduced gradient has not been delivered yet."""
        return len(self._in_flight)

    def _push(self, requests: List[Request]) -> None:
        """Queue the requests of the step just started (in slot ``steps mod
        slots``)."""
        self._in_flight.append((self.steps % self.slots, requests))
        self.steps += 1

    def _pop_due(self) -> Optional[int]:
        """Once more than ``staleness`` steps are in flight, wait for the
        oldest and return its slot -- the next step's -- else None.  Every
        request of that step is waited for before an error is raised."""
        if len(self._in_flight) <= self.staleness:
            self.delivered = False
            return None
        slot, oldest = self._in_flight.popleft()
        wait_all(oldest)
        self.delivered = True
        return slot

    def discard_in_flight(self) -> int:
        """Wait for the steps still in flight and drop their reduced gradients
        (the end of training: with ``staleness`` the last ``s`` steps' are
        never applied); returns how many steps that was."""
        n = len(self._in_flight)
        while self._in_flight:
            wait_all(self._in_flight.popleft()[1])
        return n

    def _slot_arrays(self, slot: int) -> List[np.ndarray]:
        """Host copies of a slot's bucket storage (for :meth:`state_dict`)."""
        raise NotImplementedError

    def _load_slot(self, slot: int, arrays: Sequence[np.ndarray]) -> None:
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        return self.reducer.stats.bytes_sent + self.dense_reducer.stats.bytes_sent

    @property
    def comm_time(self) -> float:
        """Seconds spent in MPI transfers (and device staging), both reducers."""
        return self.reducer.stats.t_comm + self.dense_reducer.stats.t_comm

    @property
    def reduce_time(self) -> float:
        """Seconds spent in the reducers: encode, communication and decode."""
        return self.reducer.stats.t_total + self.dense_reducer.stats.t_total

    def plan(self) -> List[Tuple[str, bool, List[str]]]:
        """``(key, dense, names)`` per bucket."""
        return [(b.key, b.dense, list(b.names)) for b in self.buckets]

    def state_dict(self) -> dict:
        """The reducers' state (error feedback, seeds); with ``staleness`` also
        the reduced gradients still to be delivered, so a restart delivers
        them as the uninterrupted run would."""
        state = {"reducer": self.reducer.state_dict(), "dense": self.dense_reducer.state_dict()}
        if self.staleness:
            # the reducers' state_dict waited for every request: all are complete
            state.update(staleness=self.staleness, steps=self.steps,
                         pending=[self._slot_arrays(slot) for slot, _ in self._in_flight])
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("staleness", 0)
        if saved != self.staleness:
            raise ValueError(f"state was saved with staleness={saved}, "
                             f"this runner has staleness={self.staleness}")
        self.reducer.load_state_dict(state["reducer"])
        self.dense_reducer.load_state_dict(state["dense"])
        if self.staleness:
            self.discard_in_flight()
            self.steps = int(state["steps"])
            pending = state["pending"]
            self._in_flight.clear()
            for k, arrays in enumerate(pending):
                slot = (self.steps - len(pending) + k) % self.slots
                self._load_slot(slot, arrays)
                self._in_flight.append((slot, []))
            self.delivered = len(pending) == self.staleness
