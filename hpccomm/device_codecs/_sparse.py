"""The flow shared by the sparsifier twins (``threshold``, ``adaptive``,
``randk``): the three-step forms of :class:`~hpccomm.device_codecs.base.DeviceCodec`
with the decode fused into the encoder's write pass.

A twin implements

``_run(v, fresh, check, resid, out, ctx, owner)``
    the packet of ``v`` (the host codec's ``encode``, or ``reencode`` with
    ``owner``), counting NaN/Inf in ``v`` when ``check``; where ``resid`` is
    given it holds ``v`` and becomes ``v - decode(packet)``; where ``out`` is
    given it becomes ``decode(packet)`` (``out`` may be ``v`` itself)
``_read(packets, n)``
    launch the validation of received packets (their payload's indices,
    counts, fields) and read the result back in **one** host round trip for
    all of them; raise :class:`~hpccomm.errors.PacketError` as the host
    decoder does, before anything is written; return one reader per packet
``_apply(reader, out, mode)``
    decode a validated packet into ``out``: :data:`SET` (zeros elsewhere),
    :data:`ADD` or :data:`SUB` (``out - decode``)

and the base class here composes them:

``encode_with_feedback``
    ``v = x + e`` formed in ``e_out`` (one elementwise pass), then ``_run``
    with ``fresh = x`` under ``ctx.feedback``
``owner_step``
    ``_read`` of the ``P`` packets (one round trip), ``out = 0`` and one
    scatter-add launch per packet in rank order (the stream keeps the order),
    ``w = out + e`` (in ``e_out``), then ``_run(w, ...)`` with ``fresh = acc``
    (``out``, read before the write pass rewrites it) under ``ctx.feedback``
    with a residual
``decode``
    ``_read`` (one round trip) and ``_apply``
"""
from __future__ import annotations

import numpy as np

from ..kernels import cuda_util as U
from .base import DeviceCodec

#: decode modes: out = decode, out += decode, out -= decode
SET, ADD, SUB = 0, 1, 2


class SparseDevice(DeviceCodec):
    """Base of the sparsifier twins (see the module docstring)."""

    def zeroed(self, name: str, n: int, dtype=np.int64):
        """A kept device buffer of ``n`` zeros."""
        return U.fill(self.scratch(name, n, dtype), 0)

    def _check_sizes(self, n, **arrays):
        for what, a in arrays.items():
            if a is not None and a.size != n:
                raise ValueError(f"{self.codec.name}: {what} has {a.size} elements, not {n}")

    # -- the contract -----------------------------------------------------------
    def encode_with_feedback(self, x, e, e_out, ctx):
        n = x.size
        self._check_sizes(n, e=e, e_out=e_out)
        if e_out is not None:
            v = U.copy(x, e_out) if e is None else U.add(x, e, e_out)
        else:
            v = x if e is None else U.add(x, e, self.scratch("v", n))
        check = self.codec.nonfinite == "raise" and not (ctx.finite and
                                                         (e is None or e_out is None))
        fresh = x if ctx.feedback else ctx.fresh
        return self._run(v, fresh, check, e_out, None, ctx, owner=False)

    def owner_step(self, received, e, e_out, out, ctx):
        n = out.size
        self._check_sizes(n, e=e, e_out=e_out)
        readers = self._read(list(received), n)
        U.fill(out, 0.0)
        for reader in readers:                      # rank order
            self._apply(reader, out, ADD)
        if e is not None:
            w = U.add(out, e, e_out if e_out is not None else self.scratch("w", n))
        elif e_out is not None:
            w = U.copy(out, e_out)
        else:
            w = out
        check = self.codec.nonfinite == "raise" and not ctx.finite
        fresh = out if e_out is not None and ctx.feedback else ctx.fresh
        return self._run(w, fresh, check, e_out, out, ctx, owner=True)

    def _decode_into(self, packet, out, add=False, subtract=False):
        (reader,) = self._read([packet], out.size)
        self._apply(reader, out, ADD if add else SUB if subtract else SET)

    def _encode(self, v, ctx):
        return self._run(v, ctx.fresh, False, None, None, ctx, owner=False)

    def _reencode(self, w, ctx):
        return self._run(w, ctx.fresh, False, None, None, ctx, owner=True)

    # -- to implement -------------------------------------------------------------
    def _run(self, v, fresh, check, resid, out, ctx, owner):
        raise NotImplementedError

    def _read(self, packets, n):
        raise NotImplementedError

    def _apply(self, reader, out, mode):
        raise NotImplementedError
