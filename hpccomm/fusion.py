"""Fusion buckets: many gradient tensors, few collective calls.

A model's gradients are dozens of arrays of very different sizes.  Reducing
each on its own pays the per-call latency dozens of times; reducing them
fused into a few flat buckets (Horovod's tensor fusion, DDP's buckets) pays it
once per bucket.  :class:`GradientBuckets` plans the buckets once from the
tensors' names and shapes, then every step copies the gradients in, reduces
each bucket with one call, and copies the results back out.

Layer filters (as in DGC and CGX): tensors that are small (fewer than
``min_compress`` elements) or one-dimensional (biases, norms), and any name
listed in ``dense``, go to the *dense* reducer (plain ``MPI_Allreduce`` by
default) -- compressing them saves nothing and hurts accuracy most.

Keys are stable across steps (``"<prefix>/<bucket index>"``) so that error
feedback follows each bucket.  ``bucket_bytes=0`` reduces every compressed
tensor on its own with its own shape (for per-column codecs such as
``onebit``, whose columns come from the tensor's last axis).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .core import Allreducer


@dataclass
class Bucket:
    key: str
    names: List[str]
    offsets: List[int]
    sizes: List[int]
    shapes: List[tuple]
    buffer: np.ndarray
    dense: bool
    #: reduce with this shape (single-tensor buckets keep the tensor's shape)
    shape: tuple = field(default=())


class GradientBuckets:
    """Plan and run bucketed reductions of named float32 gradients.

    Parameters
    ----------
    shapes:
        ``{name: shape}`` of the gradients, in a fixed order (the same on every
        rank).
    reducer:
        The :class:`~hpccomm.Allreducer` for compressible tensors.
    dense_reducer:
        The reducer for filtered tensors (default: ``codec="none",
        algorithm="mpi"`` on the same communicator with the same op).
    bucket_bytes:
        Upper bound of a bucket's size (a larger tensor gets a bucket of its
        own); 0 gives every compressed tensor its own call and shape.
    min_compress:
        Tensors with fewer elements are reduced dense.
    dense:
        Names always reduced dense (e.g. a full-precision last layer).
    compress_1d:
        Compress one-dimensional tensors too (default False).
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], reducer: Allreducer, *,
                 dense_reducer: Optional[Allreducer] = None, bucket_bytes: int = 25 << 20,
                 min_compress: int = 1024, dense: Iterable[str] = (), compress_1d: bool = False,
                 prefix: str = "grads"):
        self.reducer = reducer
        self.dense_reducer = dense_reducer or Allreducer(reducer.parent, codec="none",
                                                         algorithm="mpi", op=reducer.op)
        if self.dense_reducer.op != reducer.op:
            raise ValueError("reducer and dense_reducer must use the same op")
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        dense = set(dense)
        unknown = dense - set(self.shapes)
        if unknown:
            raise KeyError(f"dense names not among the gradients: {sorted(unknown)}")
        groups: Dict[bool, List[str]] = {True: [], False: []}
        for name, shape in self.shapes.items():
            size = int(np.prod(shape)) if shape else 1
            is_dense = (name in dense or size < min_compress
                        or (len(shape) <= 1 and not compress_1d))
            groups[is_dense].append(name)
        self.buckets: List[Bucket] = []
        if bucket_bytes < 0:
            raise ValueError("bucket_bytes must be >= 0")
        self._plan(groups[False], False, bucket_bytes, prefix)
        # dense tensors are always fused (their shapes do not matter to MPI_Allreduce)
        self._plan(groups[True], True, bucket_bytes or (25 << 20), prefix)

    def _plan(self, names: List[str], is_dense: bool, limit: int, prefix: str) -> None:
        current: List[str] = []
        current_bytes = 0

        def close():
            nonlocal current, current_bytes
            if not current:
                return
            sizes = [int(np.prod(self.shapes[n])) if self.shapes[n] else 1 for n in current]
            offsets = list(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int))
            shape = self.shapes[current[0]] if len(current) == 1 else (sum(sizes),)
            kind = "dense" if is_dense else "bucket"
            self.buckets.append(Bucket(
                key=f"{prefix}/{kind}{len(self.buckets)}", names=list(current), offsets=offsets,
                sizes=sizes, shapes=[self.shapes[n] for n in current],
                buffer=np.empty(sum(sizes), dtype=np.float32), dense=is_dense, shape=shape))
            current, current_bytes = [], 0

        for name in names:
            nbytes = 4 * (int(np.prod(self.shapes[name])) if self.shapes[name] else 1)
            if current and (limit == 0 or current_bytes + nbytes > limit):
                close()
            current.append(name)
            current_bytes += nbytes
        close()

    def plan(self) -> List[Tuple[str, bool, List[str]]]:
        """``(key, dense, names)`` per bucket."""
        return [(b.key, b.dense, list(b.names)) for b in self.buckets]

    def reduce(self, grads: Mapping[str, np.ndarray]) -> None:
        """Reduce ``grads`` in place (every array gets its reduced value)."""
        missing = set(self.shapes) - set(grads)
        if missing:
            raise KeyError(f"gradients missing: {sorted(missing)}")
        for b in self.buckets:
            for name, off, size in zip(b.names, b.offsets, b.sizes):
                g = grads[name]
                if g.shape != self.shapes[name]:
                    raise ValueError(f"{name}: shape {g.shape}, planned {self.shapes[name]}")
                b.buffer[off:off + size] = g.reshape(-1)
            reducer = self.dense_reducer if b.dense else self.reducer
            view = b.buffer.reshape(b.shape) if b.shape else b.buffer
            reducer(view, key=b.key, out=view)
            for name, off, size in zip(b.names, b.offsets, b.sizes):
                grads[name].reshape(-1)[...] = b.buffer[off:off + size]

    def state_dict(self) -> dict:
        return {"reducer": self.reducer.state_dict(), "dense": self.dense_reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state["reducer"])
        self.dense_reducer.load_state_dict(state["dense"])

    @property
    def bytes_sent(self) -> int:
        return self.reducer.stats.bytes_sent + self.dense_reducer.stats.bytes_sent

    @property
    def comm_time(self) -> float:
        return self.reducer.stats.t_total + self.dense_reducer.stats.t_total
