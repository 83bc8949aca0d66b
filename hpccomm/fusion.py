"""Fusion buckets for named numpy gradients: :class:`GradientBuckets`.

The plan, the layer filters and the bucket keys are :mod:`hpccomm.buckets`'s;
here every step copies the gradients into each bucket's flat float32 buffer,
reduces it with one call, and copies the results back out.

With ``staleness=s`` (bounded staleness, :mod:`hpccomm.buckets`) there are
``s + 1`` sets of these buffers; :meth:`GradientBuckets.reduce` then starts
this step's buckets and writes the reduced gradient of ``s`` steps ago into
the arrays (zeros, returning False, in the first ``s`` steps)::

    buckets = GradientBuckets(shapes, reducer, staleness=1)
    for step in range(steps):
        grads = model.gradients(batch(step))
        if buckets.reduce(grads):          # now step - 1's mean gradient
            optimizer.step(grads)
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from .buckets import Bucket, BucketRunner, plan_buckets
from .core import Allreducer

__all__ = ["GradientBuckets", "Bucket", "plan_buckets"]


class GradientBuckets(BucketRunner):
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
    staleness:
        Deliver each step the reduced gradient of ``staleness`` steps earlier
        (default 0: this step's, synchronously).
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], reducer: Allreducer, *,
                 dense_reducer: Optional[Allreducer] = None, bucket_bytes: int = 25 << 20,
                 min_compress: int = 1024, dense: Iterable[str] = (), compress_1d: bool = False,
                 prefix: str = "grads", staleness: int = 0):
        super().__init__(shapes, reducer, dense_reducer, bucket_bytes=bucket_bytes,
                         min_compress=min_compress, dense=dense, compress_1d=compress_1d,
                         prefix=prefix, staleness=staleness)
        self._slots = [[np.empty(b.numel, dtype=np.float32) for b in self.buckets]
                       for _ in range(self.slots)]
        self._flats = self._slots[0]
        self._target = None             # the arrays given to start(), until finish()
        for b, flat in zip(self.buckets, self._flats):
            b.buffer = flat

    def reduce(self, grads: Mapping[str, np.ndarray]) -> bool:
        """Reduce ``grads`` in place: every array gets its reduced value -- of
        this step, or with ``staleness`` of ``staleness`` steps earlier.
        Returns whether a reduced gradient was delivered (False, and zeros,
        only in the first ``staleness`` steps)."""
        if self.staleness:
            self.start(grads)
            return self.finish()
        self._check(grads)
        self.run(self._flats, lambda b, flat: self._fill(grads, b, flat),
                 lambda b, flat: self._drain(grads, b, flat))
        return True

    def start(self, grads: Mapping[str, np.ndarray]) -> None:
        """Copy ``grads`` into the buckets and start every bucket's reduction
        (non-blocking); :meth:`finish` waits and writes the reduced values
        back into the same arrays.  The arrays may be reused (not read by the
        reduction) as soon as ``start`` returns."""
        if self._target is not None:
            raise RuntimeError("start() called again before finish()")
        self._check(grads)
        flats = self._slots[self.steps % self.slots]
        for b, flat in zip(self.buckets, flats):
            self._fill(grads, b, flat)
        self._push([self.start_bucket(i, flat) for i, flat in enumerate(flats)])
        self._target = grads

    def finish(self) -> bool:
        """Write the reduced values into the arrays given to :meth:`start`
        (after waiting for them): this step's, or with ``staleness`` those
        of ``staleness`` steps earlier.  Returns whether a reduced gradient
        was delivered (False, and zeros, in the first ``staleness`` steps)."""
        grads = self._target
        if grads is None:
            raise RuntimeError("finish() without start()")
        self._target = None
        slot = self._pop_due()
        if slot is None:
            for g in grads.values():
                g[...] = 0
            return False
        for b, flat in zip(self.buckets, self._slots[slot]):
            self._drain(grads, b, flat)
        return True

    def _slot_arrays(self, slot: int):
        return [flat.copy() for flat in self._slots[slot]]

    def _load_slot(self, slot: int, arrays) -> None:
        for flat, a in zip(self._slots[slot], arrays):
            flat[...] = a

    def _check(self, grads: Mapping[str, np.ndarray]) -> None:
        missing = set(self.shapes) - set(grads)
        if missing:
            raise KeyError(f"gradients missing: {sorted(missing)}")

    def _fill(self, grads, b, flat) -> None:
        for name, off, size in zip(b.names, b.offsets, b.sizes):
            g = grads[name]
            if g.shape != self.shapes[name]:
                raise ValueError(f"{name}: shape {g.shape}, planned {self.shapes[name]}")
            flat[off:off + size] = g.reshape(-1)

    @staticmethod
    def _drain(grads, b, flat) -> None:
        for name, off, size in zip(b.names, b.offsets, b.sizes):
            grads[name].reshape(-1)[...] = flat[off:off + size]
