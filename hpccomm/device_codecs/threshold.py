"""``threshold`` on the device: Strom's words of :mod:`hpccomm.codecs.threshold`,
byte for byte.

Kernels (:mod:`hpccomm.kernels.cuda_select`), per encode of ``n`` elements:

1. ``tau``: the fixed one (written by a one-element fill), or ``alpha *
   RMS(g)`` of the fresh part ``g`` (``x`` under error feedback, the owner's
   received sum at an owner with a residual, else ``v``): the float64 sum of
   squares in the CPU's order, one pass over ``g`` (a thread per block lane)
   and one thread that adds the lanes and blocks in order and forms the
   float32 ``tau`` -- it stays on the device.
2. Count: one pass over ``v``, each thread a segment; the candidates
   ``|v_i| >= tau, v_i != 0`` per segment, the NaN/Inf count, an exclusive
   scan of the segment counts on the device.  **Round trip**: 16 bytes (the
   NaN/Inf count and the entry count ``m``) -- the host needs ``m`` for the
   packet's size.
3. Capacity (only when ``m > cap``): a radix selection of the ``cap``-th
   largest ``|v|`` among the candidates, four histogram passes over ``v``,
   then a counting pass (entries above the cut, entries equal to it) and two
   scans: every candidate above the cut and the first ``q`` equal to it in
   index order -- ``keep_largest``'s ties to the lower index.  No round trip:
   ``m = cap``.
4. Write: one pass over ``v``, each segment writing its words from its
   scanned start (strictly increasing indices), ``e_out[i] -= +-tau`` at the
   sent entries (``e_out`` holds ``v``; ``v - 0.0 == v`` elsewhere) and, at an
   owner, ``out = decode(packet)`` (every element written).  The header, tau
   and padding are written by one-thread kernels from arguments and device
   values.

``encode_with_feedback``: one elementwise pass (``v = x + e`` into
``e_out``), then 1.-4.: three passes over memory without the cap (two over
``v``, one over ``x`` with ``alpha``), five more with it; one round trip.

``decode``: a validation kernel over the words (strictly increasing inside
``[0, n)``; tau finite and >= 0; zero padding) whose two flags come back in
one round trip (16 bytes) before anything is written, then a dense zero fill
(``decode``) and a scatter.  ``owner_step``: the ``P`` packets validated
with one round trip, ``out = 0``, ``P`` scatter-add launches in rank order,
``w = out + e``, then 1.-4. on ``w`` with ``fresh = out``: two round trips.
"""
from __future__ import annotations

import numpy as np

from ..codecs.threshold import PREFIX, Threshold, word_dtype
from ..errors import PacketError
from ..kernels import cuda_select as S
from ..kernels import cuda_util as U
from ._sparse import ADD, SET, SUB, SparseDevice
from .base import register_device_codec


@register_device_codec("threshold")
class ThresholdDevice(SparseDevice):
    host = Threshold

    def _tau(self, v, fresh):
        """The device scalar ``tau`` of the host codec's ``_threshold``."""
        codec, n = self.codec, v.size
        tau = self.scratch("tau", 1, np.float32)
        if codec.tau is not None:
            return U.fill(tau, np.float32(codec.tau))
        if n == 0:
            return U.fill(tau, 0)
        g = v if fresh is None else fresh
        if g.size != n:
            raise ValueError(f"threshold: the fresh part has {g.size} elements, the "
                             f"input {n}")
        return S.threshold_tau(g, codec.alpha, tau, self.scratch)

    def _run(self, v, fresh, check, resid, out, ctx, owner):
        n = v.size
        tau = self._tau(v, fresh)
        status = self.zeroed("status", 3)
        sel = S.Selection(v, tau, status, self.scratch)
        sel.count(check)
        bad, m = (int(a) for a in U.to_host(status[:2]))
        self.raise_nonfinite(bad)
        cap = self.codec.max_count(n)
        if m > cap:
            sel.cap(cap)
            m = cap
        wd = word_dtype(n)
        packet = self.new_packet(PREFIX + wd.itemsize * m, n, extra=m)
        S.write_tau(packet[16:PREFIX].view(np.float32), tau, m)
        sel.write(packet[PREFIX:].view(wd), resid, out)
        return packet

    def _read(self, packets, n):
        wd = word_dtype(n)
        flags = self.zeroed("flags", 2 * max(1, len(packets)))
        readers = []
        for p, packet in enumerate(packets):
            packet = S.aligned(packet, self.scratch, f"packet{p}")
            m = (packet.size - PREFIX) // wd.itemsize
            fields = packet[16:PREFIX].view(np.float32)
            words = packet[PREFIX:PREFIX + wd.itemsize * m].view(wd)
            S.check_sign_words(words, n, fields, flags, 2 * p)
            readers.append((words, fields))
        if not readers:
            return readers
        bad = U.to_host(flags)
        for p, (words, fields) in enumerate(readers):
            if bad[2 * p]:
                tau, pad = U.to_host(fields)[0], U.to_host(fields.view(np.uint32))[1]
                raise PacketError(f"{self.codec.name}: bad tau {tau!r} or padding {int(pad)}")
            if bad[2 * p + 1]:
                raise PacketError(f"{self.codec.name}: word indices are not strictly "
                                  f"increasing inside [0, {n})")
        return readers

    def _apply(self, reader, out, mode):
        words, fields = reader
        if mode == SET:
            U.fill(out, 0.0)
        S.scatter_sign_words(words, fields, out, {SET: 0, ADD: 1, SUB: 2}[mode])
