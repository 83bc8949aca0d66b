"""``randk`` on the device: the packets of :mod:`hpccomm.codecs.randk`, byte
for byte.

Indices: Floyd's algorithm under the packet's index key
(:func:`hpccomm.kernels.cuda_select.floyd_indices`).  Its draws run in **one
device thread**: draw ``j`` takes ``t = hash(key, j) % (j + 1)`` or, when
``t`` is already in the set, ``j`` -- every draw depends on the set the
earlier ones built, and parity demands that very sequence.  A zero fill of
the ``n``-bit bitmap before, and two segment passes over the bitmap and a
scan after (the indices come out sorted), run in parallel.  The indices
depend on ``(key, n, k)`` alone: the twin keeps the last :data:`CACHE` of
them on the device (a step's encode, the owner's decodes and its reencode
share one key per chunk), with an event that a call on another stream waits
for.

Per encode: the ``v = x + e`` pass (``e_out``), a NaN/Inf count (one pass,
**one round trip** of 8 bytes, skipped under ``ctx.finite`` or
``nonfinite="propagate"``), the indices (cached or regenerated), and one
gather kernel over the ``k`` indices writing the values (scaled by the
float32 ``n / k`` through ``fmul_rn`` when unbiased and not under
feedback), and ``e_out[i] -= value`` there.  The key is written into the
packet by a one-element fill from the host's value.

Decode: the host decoder validates nothing past the header (``extra == k``
is a header check; any key decodes), and neither does this one; the key is
read back to the host (**one round trip**, 8 bytes per packet -- the
indices are looked up by it), then a dense zero fill (``decode``) and a
scatter.  ``owner_step``: the ``P`` keys read back in one round trip,
``out = 0``, ``P`` scatter-add launches in rank order, ``w = out + e``, the
NaN/Inf count (second round trip), then the owner's ``reencode``: the
values of ``w`` at the indices of ``ctx``'s key, unscaled, ``e_out = w -
decode`` there and ``out = decode`` (a zero fill and a scatter).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import cuda

from ..codecs.randk import PREFIX, RandK, index_key
from ..codecs.sparsifier import index_dtype
from ..kernels import cuda_select as S
from ..kernels import cuda_util as U
from ._sparse import ADD, SET, SUB, SparseDevice
from .base import register_device_codec

#: index sets kept on the device (by key, n, k)
CACHE = 16


@register_device_codec("randk")
class RandKDevice(SparseDevice):
    host = RandK

    def __init__(self, codec):
        super().__init__(codec)
        self._indices: "OrderedDict[tuple, object]" = OrderedDict()

    def indices(self, key: int, n: int, k: int):
        """The ``k`` sorted indices of ``key`` (a device array, cached).  A
        set made on another stream is waited for (an event) before the
        current stream uses it."""
        slot = (int(key), n, k)
        stream = U.current_stream()
        hit = self._indices.get(slot)
        if hit is not None:
            idx, made_on, done = hit
            self._indices.move_to_end(slot)
            if made_on is not stream:
                done.wait(stream)
            return idx
        idx = S.floyd_indices(key, n, U.empty(k, index_dtype(n)), self.scratch)
        done = cuda.event()
        done.record(stream)
        self._indices[slot] = (idx, stream, done)
        if len(self._indices) > CACHE:
            self._indices.popitem(last=False)
        return idx

    def _run(self, v, fresh, check, resid, out, ctx, owner):
        codec, n = self.codec, v.size
        k = codec.count(n)
        if check and n:
            self.raise_nonfinite(U.count_nonfinite(v))
        key = index_key(ctx.seed, ctx.step, ctx.offset)
        idx = self.indices(key, n, k)
        packet = self.new_packet(codec.wire_size(n), n, extra=k)
        U.fill(packet[16:PREFIX].view(np.uint64), key)
        vals = packet[PREFIX:].view(np.float32)
        scale = None
        if not owner and codec.unbiased and k and not ctx.feedback:
            scale = np.float32(n / k)
        S.gather(v, idx, vals, scale, resid)
        if out is not None:
            U.fill(out, 0.0)
            S.scatter_values(idx, vals, out, 0)
        return packet

    def _read(self, packets, n):
        k = self.codec.count(n)
        keys = self.scratch("keys", max(1, len(packets)), np.uint64)
        aligned = [S.aligned(p, self.scratch, f"packet{j}") for j, p in enumerate(packets)]
        for j, packet in enumerate(aligned):
            S.read_u64(packet, 16, keys, j)
        if not aligned:
            return []
        host = U.to_host(keys)
        return [(self.indices(int(host[j]), n, k), packet[PREFIX:PREFIX + 4 * k].view(np.float32))
                for j, packet in enumerate(aligned)]

    def _apply(self, reader, out, mode):
        idx, vals = reader
        if mode == SET:
            U.fill(out, 0.0)
        S.scatter_values(idx, vals, out, {SET: 0, ADD: 1, SUB: 2}[mode])
