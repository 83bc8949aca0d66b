"""Reduce a PyTorch model's gradients through hpccomm, in place.

    from hpccomm.torch_grads import GradReducer

    reducer = GradReducer(model, codec="onebit", algorithm="twoshot", op="mean")
    for x, y in loader:
        opt.zero_grad(set_to_none=False)   # keeps the zero-copy views (see below)
        loss_fn(model(x), y).backward()
        reducer()                          # every .grad now holds the reduced value
        opt.step()

The parameters are planned into fusion buckets once
(:mod:`hpccomm.buckets`: small and 1-D tensors, and names in
``dense``, go to a dense ``MPI_Allreduce``).  Each bucket owns one flat
float32 tensor on the parameters' device, and every ``p.grad`` is made a view
of its slice (``p.grad = flat[off:off+n].view_as(p)``), so autograd
accumulates straight into the bucket and ``reducer()`` reduces each bucket in
place with one call and no copies.  CPU tensors reach MPI as zero-copy numpy
views; CUDA tensors through ``__cuda_array_interface__`` / DLPack (directly
with CUDA-aware MPI, else staged through pinned host buffers).

If a gradient is no longer the bucket's view when ``reducer()`` runs (e.g.
after ``zero_grad(set_to_none=True)``, PyTorch's default, or when a parameter
got no gradient), it is copied into the bucket (zeros for ``None``) and the
view is restored: correct, at the cost of one copy.

``overlap=True`` reduces while backward still computes (DDP's scheme): a
post-accumulate-grad hook on every parameter counts the gradients each bucket
still waits for, and a bucket's reduction starts (non-blocking,
:mod:`hpccomm.requests`) as soon as it has them all -- the buckets in one fixed
order (by each bucket's earliest parameter, last first), whatever order the
hooks fire in, so every rank starts the
same keys in the same order.  ``reducer()`` (or ``reducer.finish()``) then waits
for them; a bucket with a parameter that got no gradient (and every bucket
after it in that order) starts only there, with zeros for it.  The
results are bit-identical to ``overlap=False``.  One backward per step: call
``reducer()`` before the next backward.  A started bucket is reduced in place,
so between backward and ``reducer()`` its ``.grad`` tensors are in flux: read
or change them only after ``reducer()`` returns (or copy them in a
post-accumulate-grad hook registered before the reducer's).

``staleness=s`` (bounded staleness, :mod:`hpccomm.buckets`) keeps ``s + 1``
sets of buckets: ``reducer()`` starts this step's buckets (or, with overlap,
the rest of them), waits only for those of ``s`` steps ago, and makes every
``p.grad`` a view of *their* buckets -- so the optimizer applies the reduced
gradient of ``s`` steps ago, and the next backward accumulates into that set,
free again.  No copies: the views move, not the data.  In the first ``s``
steps nothing is delivered (``.grad`` is zero, ``reducer.delivered`` False)::

    reducer = GradReducer(model, codec="terngrad", overlap=True, staleness=1)
    for x, y in loader:
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        reducer()
        if reducer.delivered:              # the mean gradient of the step before
            opt.step()

Hold no reference to a ``.grad`` across steps: with ``staleness`` it is a
different tensor every step.

An optimizer that reduces something other than the gradient (the momentum of
:class:`hpccomm.optim.OneBitAdam`, the accumulated update of
:class:`~hpccomm.optim.ZeroOneAdam`) takes the buckets over with
:meth:`GradReducer.reduce_with`: it is handed each bucket's gradient storage
when the bucket is complete -- during backward with ``overlap=True`` -- and
starts whatever reduction it wants, or none, so that its communication has
the same buckets and the same overlap.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Tuple, Union

import numpy as np

from .buckets import BucketRunner, wait_all
from .core import Allreducer
from .requests import Request

#: ``start(index, flat)``: what reduces bucket ``index`` (see :meth:`GradReducer.reduce_with`)
BucketStart = Callable[[int, "torch.Tensor"], Optional[Request]]  # noqa: F821


def _named_parameters(params) -> list:
    if hasattr(params, "named_parameters"):
        items = list(params.named_parameters())
    else:
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(f"param{i}", p) for i, p in enumerate(items)]
    return [(n, p) for n, p in items if p.requires_grad]


class GradReducer(BucketRunner):
    """Bucketed in-place reduction of ``.grad`` tensors (see module docstring).

    ``params`` is a ``torch.nn.Module``, an iterable of parameters or of
    ``(name, parameter)`` pairs -- the same, in the same order, on every rank.
    Remaining keyword arguments go to the compressed :class:`~hpccomm.Allreducer`
    (``error_feedback``, ``seed``, ``gpu_aware``, codec options...).
    """

    def __init__(self, params: Union["torch.nn.Module", Iterable], comm=None, *,  # noqa: F821
                 codec: str = "none", algorithm: Optional[str] = None, op: str = "mean",
                 bucket_bytes: int = 25 << 20, min_compress: int = 1024,
                 dense: Iterable[str] = (), compress_1d: bool = False, overlap: bool = False,
                 staleness: int = 0, **reducer_options):
        import torch

        self._torch = torch
        self.named = _named_parameters(params)
        if not self.named:
            raise ValueError("no parameters that require gradients")
        for name, p in self.named:
            if p.dtype != torch.float32:
                raise TypeError(f"{name}: {p.dtype} parameters are not supported (float32 only)")
        devices = {p.device for _, p in self.named}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        gpu_aware = reducer_options.get("gpu_aware", "auto")
        super().__init__({n: tuple(p.shape) for n, p in self.named},
                         Allreducer(comm, codec=codec, algorithm=algorithm, op=op,
                                    **reducer_options),
                         Allreducer(comm, codec="none", algorithm="mpi", op=op,
                                    gpu_aware=gpu_aware),
                         bucket_bytes=bucket_bytes, min_compress=min_compress, dense=dense,
                         compress_1d=compress_1d, prefix="torch", staleness=staleness)
        self._param = dict(self.named)
        #: what reduces a complete bucket (None: its gradients, in place)
        self._start: Optional[BucketStart] = None
        #: per slot (one without staleness), the buckets' flat storage and per
        #: parameter its view of its bucket; and per parameter its bucket's index
        self._slots = []
        self._bucket_of = {}
        for _ in range(self.slots):
            flats, views = [], {}
            for i, b in enumerate(self.buckets):
                flat = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
                flats.append(flat)
                for name, off, size in zip(b.names, b.offsets, b.sizes):
                    views[name] = flat[off:off + size].view_as(self._param[name])
                    self._bucket_of[name] = i
            self._slots.append((flats, views))
        self._flat, self._view = self._slots[0]
        for name, p in self.named:
            if p.grad is not None:
                self._view[name].copy_(p.grad)
            p.grad = self._view[name]
        self.overlap = bool(overlap)
        if self.overlap:
            # backward reaches parameters last-first: a bucket is complete when its
            # earliest parameter is, so buckets start in that order (the same everywhere)
            position = {n: k for k, (n, _) in enumerate(self.named)}
            self._order = sorted(range(len(self.buckets)),
                                 key=lambda i: -min(position[n] for n in self.buckets[i].names))
            self._new_step()
            for name, p in self.named:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, name))

    def _ensure_view(self, name: str, view) -> int:
        """Make ``p.grad`` the bucket view again; return 1 if a copy was needed."""
        p = self._param[name]
        g = p.grad
        if g is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape:
            return 0
        with self._torch.no_grad():
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
        p.grad = view
        return 1

    # ------------------------------------------------------------------ overlap
    def _new_step(self) -> None:
        self._waiting = [len(b.names) for b in self.buckets]   # gradients not yet accumulated
        self._seen = set()
        self._requests = []                      # in self._order
        self._copies = 0

    def _settle(self, name: str) -> None:
        """``name``'s gradient is final for this step: back in its bucket view."""
        self._seen.add(name)
        self._copies += self._ensure_view(name, self._view[name])

    def _on_grad(self, name: str, param) -> None:
        """Post-accumulate-grad hook: the gradient of ``name`` is final for this
        backward.  A bucket starts when all its gradients are, and buckets
        start in one fixed order (last first, DDP's), whatever order the
        hooks fire in -- so every rank starts the same keys in the same order."""
        if name in self._seen:
            return                      # accumulated again in this step (reused parameter)
        self._settle(name)
        self._waiting[self._bucket_of[name]] -= 1
        while (len(self._requests) < len(self._order)
               and self._waiting[self._order[len(self._requests)]] == 0):
            i = self._order[len(self._requests)]
            self._requests.append(self._start_bucket(i))

    def reduce_with(self, start: Optional[BucketStart]) -> None:
        """From the next bucket on, ``start(index, flat)`` is what reduces a
        complete bucket instead of the in-place reduction of its gradients:
        it gets bucket ``index``'s flat gradient storage once every gradient
        in it is final (with ``overlap=True``, during backward; in the fixed
        order of the module docstring) and returns a
        :class:`~hpccomm.requests.Request` that :meth:`finish` waits for, or
        None.  ``reduce_with(None)`` restores the gradients' reduction.  Set
        it between steps, the same on every rank; not with ``staleness``."""
        if start is not None and self.staleness:
            raise ValueError("reduce_with() does not combine with staleness")
        self._start = start

    def _start_bucket(self, index: int) -> Optional[Request]:
        if self._start is not None:
            return self._start(index, self._flat[index])
        return self.start_bucket(index, self._flat[index])

    @property
    def started(self) -> int:
        """Buckets of this step whose reduction has started (``overlap=True``)."""
        return len(self._requests) if self.overlap else 0

    def finish(self) -> int:
        """Wait for every bucket of this step (starting, in order, those whose
        parameters got no gradient: zeros); returns how many gradients had to
        be copied into their bucket."""
        if not self.overlap:
            return self()
        for i in self._order[len(self._requests):]:
            for name in self.buckets[i].names:
                if name not in self._seen:
                    self._settle(name)
            self._requests.append(self._start_bucket(i))
        copies = self._copies
        try:
            if self.staleness:
                self._deliver(self._requests)
            else:
                wait_all([req for req in self._requests if req is not None])
        finally:
            self._new_step()
        return copies

    def __call__(self) -> int:
        """Reduce every gradient in place; returns how many had to be copied.
        With ``overlap=True`` the buckets were started during backward: this
        waits for them (:meth:`finish`)."""
        if self.overlap:
            return self.finish()
        copies = 0

        def ensure_views(b, flat):
            nonlocal copies
            for name in b.names:
                copies += self._ensure_view(name, self._view[name])

        if self.staleness:
            for b in self.buckets:
                ensure_views(b, None)
            self._deliver([self.start_bucket(i, flat) for i, flat in enumerate(self._flat)])
        elif self._start is not None:
            requests = []
            try:
                for i, b in enumerate(self.buckets):
                    ensure_views(b, None)
                    requests.append(self._start_bucket(i))
            finally:          # nothing left running, whatever raised
                wait_all([req for req in requests if req is not None])
        else:
            self.run(self._flat, ensure_views)
        return copies

    # ---------------------------------------------------------------- staleness
    def _deliver(self, requests) -> None:
        """This step's buckets are started: wait for those of ``staleness``
        steps ago and point every ``.grad`` at them (zeros while none is due)."""
        self._push(requests)
        slot = self._pop_due()
        nxt = self.steps % self.slots
        assert slot is None or slot == nxt
        self._use_slot(nxt)
        if slot is None:
            with self._torch.no_grad():
                for flat in self._flat:
                    flat.zero_()

    def _use_slot(self, slot: int) -> None:
        self._flat, self._view = self._slots[slot]
        for name, p in self.named:
            p.grad = self._view[name]

    def _slot_arrays(self, slot: int):
        return [flat.detach().cpu().numpy().copy() for flat in self._slots[slot][0]]

    def _load_slot(self, slot: int, arrays) -> None:
        with self._torch.no_grad():
            for flat, a in zip(self._slots[slot][0], arrays):
                flat.copy_(self._torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.staleness:
            self._use_slot(self.steps % self.slots)

    @property
    def stats(self) -> Tuple:
        return self.reducer.stats, self.dense_reducer.stats
