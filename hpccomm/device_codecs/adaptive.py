"""``adaptive`` on the device: the per-column packets of
:mod:`hpccomm.codecs.adaptive`, byte for byte.

Kernels (:mod:`hpccomm.kernels.cuda_select`), one thread per column of
``H`` rows -- the float64 sums of a column run over its rows in order, as on
the CPU, so a column is one thread's:

1. Statistics (:func:`~hpccomm.kernels.cuda_select.adaptive_stats`): the
   sample (``samples`` rows drawn from the counter RNG, or every row of a
   short column) counted by sign, each sign's ``max(1, s // pi)``-th largest
   by a radix selection over the sampled bit patterns (four passes over the
   sample, the draws recomputed: no scratch), one pass over the column for
   the NaN/Inf count, the selected counts and their row-order float64 sums,
   and, for a side over its cap, four radix passes and one summing pass
   over the column (every entry above the cut and the first ``q`` equal to
   it, ties to lower rows).  Per column the count, the float32 means and the
   cuts stay on the device.
2. An exclusive scan of the column counts (the words' offsets).  **Round
   trip**: 16 bytes, the NaN/Inf count and ``m``, for the packet's size.
3. Write (:func:`~hpccomm.kernels.cuda_select.adaptive_write`): each column
   its record ``(count, mu_pos, mu_neg)`` and its words, rows ascending, in
   one pass over the column, ``e_out -= 0 + mu`` at its sent rows and, at an
   owner, ``out = decode(packet)`` for every row.

``encode_with_feedback``: the ``v = x + e`` pass, then 1.-3.: about three
passes over ``v`` plus the sampled reads; one round trip.  ``H`` is written
by a one-element fill.

Decode: the column length ``H`` is read on the device; the validation (one
thread per column: counts adding up to ``m``, rows strictly increasing
inside each column, at most ``cap(h)`` entries per sign) runs with threads
for the most columns the packet's size allows, and its flag and ``H`` come
back in one round trip (16 bytes) before anything is written; then a zero
fill (``decode``) and one thread per column adding ``0 + mu`` at its rows.
``owner_step``: the ``P`` packets validated with one round trip, ``out =
0``, ``P`` scatter-add launches in rank order, ``w = out + e``, then 1.-3.
on ``w``: two round trips.
"""
from __future__ import annotations

import numpy as np

from ..codecs.adaptive import COLUMN_BYTES, PREFIX, SALT, Adaptive
from ..errors import PacketError
from ..kernels import cuda_select as S
from ..kernels import cuda_util as U
from ..kernels.rng import stream_key
from ._sparse import SET, SUB, SparseDevice
from .base import HEADER_SIZE, register_device_codec


@register_device_codec("adaptive")
class AdaptiveDevice(SparseDevice):
    host = Adaptive

    def _run(self, v, fresh, check, resid, out, ctx, owner):
        codec, n = self.codec, v.size
        H = codec._columns(n, ctx)
        if n == 0:
            packet = self.new_packet(PREFIX, 0)
            U.fill(packet[HEADER_SIZE:PREFIX].view(np.uint32), 0)
            return packet
        W = S.segments(n, H)
        key = stream_key(ctx.seed, ctx.rank, ctx.step, SALT)
        status = self.zeroed("status", 2)
        counts, mus, cuts = S.adaptive_stats(v, H, codec.proportion, codec.samples,
                                             codec.excess, key, ctx.offset, status, check,
                                             self.scratch)
        starts = S.exclusive_scan(counts, self.scratch("starts", W, np.int64), status, 1,
                                  self.scratch)
        bad, m = (int(a) for a in U.to_host(status))
        self.raise_nonfinite(bad)
        packet = self.new_packet(PREFIX + COLUMN_BYTES * W + 4 * m, n, extra=m)
        U.fill(packet[HEADER_SIZE:PREFIX].view(np.uint32), H)
        S.adaptive_write(v, H, counts, mus, cuts, starts, packet[PREFIX:], resid, out)
        return packet

    def _read(self, packets, n):
        if n == 0:          # the host decoder reads nothing of an empty packet
            return [None] * len(packets)
        codec = self.codec
        flags = self.zeroed("flags", 2 * max(1, len(packets)))
        readers = []
        for p, packet in enumerate(packets):
            packet = S.aligned(packet, self.scratch, f"packet{p}")
            reader = S.AdaptiveReader(packet, n, self.scratch, f"read{p}_")
            reader.check(codec.proportion, codec.excess, flags, 2 * p)
            readers.append(reader)
        if not readers:
            return readers
        got = U.to_host(flags)
        for p, reader in enumerate(readers):
            H = int(got[2 * p + 1])
            if got[2 * p]:
                m = reader.body.size - 3 * S.segments(n, H) if 1 <= H <= n else "m"
                raise PacketError(f"{codec.name}: column counts or rows are inconsistent (counts "
                                  f"must add up to {m}, rows increase inside each column, at "
                                  "most cap(h) entries per sign)")
            reader.H = H
        return readers

    def _apply(self, reader, out, mode):
        if reader is None:
            return
        if mode == SET:
            U.fill(out, 0.0)
        reader.scatter(reader.H, out, 2 if mode == SUB else 1)
