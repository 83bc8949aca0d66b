"""Device twin of ``topk`` (:mod:`hpccomm.codecs.topk`), and the pair-packet
machinery it shares with ``dgc`` (:mod:`hpccomm.device_codecs.dgc`).

The packets are the host codec's bytes: header (``extra = m``), ``m``
strictly increasing int32 indices (int64 from ``2**31`` elements), ``m``
float32 values.  The gradient never leaves the device; what crosses to the
host is small and listed below.  Kernels: the "top-k selection" section of
:mod:`hpccomm.kernels.cuda_sparsify`.

Selection (``topk``'s, steps as in the host docstring), all on the device:

1. ``t``: ``k == n`` gives ``t = 0``; a sample as long as the vector
   (``s == n``) gives the exact ``k``-th largest ``|v|`` by radix select over
   the vector's magnitude bits (:func:`~hpccomm.kernels.cuda_sparsify.radix_select`,
   three histogram passes); otherwise the ``s`` strided magnitudes are
   gathered on the device (start from the counter RNG, computed on the host
   with the host codec's function) and ``t`` is their ``r``-th largest by the
   same radix select over the ``s`` samples.  Radix select over float32 bit
   patterns is numpy's order (NaN above +inf), so ``t`` equals the host's
   ``np.partition`` result.  The sample never comes to the host.
2. Candidates ``|v| >= t, v != 0``: one counting pass (per block the number
   above ``t`` and tied with it) and, after the host has turned the counts
   into block offsets, one compaction pass writing ``(index, value)`` in
   index order -- straight into the packet when at most ``k`` pass.
3. More than ``k`` candidates: they are compacted into scratch, the exact
   ``k``-th largest candidate magnitude and the number of its ties that
   belong to the top ``k`` come from a radix select over the candidates, and
   a second compaction over the candidates keeps every magnitude above the
   cut and the first ``q`` ties in index order (the host's ``keep_largest``:
   ties to the lower index), into the packet.
4. ``exact=True`` and fewer than ``k`` candidates with ``t > 0`` (sampled
   ``t`` only): the radix select over the whole vector and steps 2-3 again.

Passes over the ``n`` elements of an encode with error feedback
(``encode_with_feedback``): compensate ``v = x + e`` into ``e_out`` with the
NaN/Inf count (one read of ``x``, ``e``, one write), the count and the
compaction (two reads of ``v``; the compaction reads its block twice, the
second time from cache), plus three radix passes over ``v`` when ``s == n``
or for the ``exact`` fallback; the residual ``e_out = v - decode`` touches
only the ``m`` sent entries (``v - 0.0 == v`` elsewhere: the bits of the
dense subtraction).  Everything else works on ``s`` samples or ``m``
candidates.

Host round trips per encode: one copy back of ``8 (4 + 2 B)`` bytes, ``B =
ceil(n / RUN_TILE)`` blocks (the threshold's bits, the NaN/Inf count, the
per-block counts), and the block offsets to the device (``16 B`` bytes);
with more than ``k`` candidates one more of each over the candidates' ``ceil(m
/ RUN_TILE)`` blocks; the ``exact`` fallback one more copy back.  The
packet's size is known on the host after the first; a NaN/Inf found by the
compensate pass raises NonFiniteError there, before a packet exists (``e_out``
then holds ``v``, as on the host).  ``dgc`` adds one copy back per threshold
decay.

``owner_step``: every received packet is validated first (one check kernel
per packet, one ``4 P``-byte copy back), then ``out = 0`` and one
scatter-add launch per packet in rank order (indices within a packet are
unique: the sum is that of the host's ``decode_add`` loop), compensate
``w = acc + e``, the selection above, the residual at the sent entries and
``out = decode(packet)`` (a fill and a scatter).  ``fresh`` is not read by
these codecs, so the owner keeps no copy of ``acc``.

Decoding a received packet: the header fields, the count (``m <= k``, from
the packet's size) and the indices (strictly increasing inside ``[0, n)``)
are checked by one kernel that raises flags; one ``int32`` comes back (per
packet), and on a flag the same :class:`~hpccomm.errors.PacketError` as the
host's is raised (header faults by the host codec's own ``check_header`` on
a copy of the leading bytes) before anything is written; then a fill (plain
decode only) and one scatter.  Packets are read through typed views of the
uint8 array, so a packet must start at an address aligned for its indices
(4 bytes; 8 for int64 indices), as
:class:`~hpccomm.device_codecs.base.NoneDevice` assumes for its values.

Ordering: outputs are positioned by integer prefix counts, values are
copied (never recomputed), residuals and sums are one float32 operation per
element: nothing depends on the launch geometry or on the order in which
blocks run.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..codecs.base import HEAD_BYTES, HEADER_SIZE
from ..codecs.sparsifier import index_dtype
from ..codecs.topk import MARGIN, SALT, PairCodec, TopK, pairs_size
from ..errors import PacketError
from ..kernels import cuda_sparsify as G
from ..kernels import cuda_util as U
from ..kernels.rng import hash_index_cpu, stream_key
from .base import DeviceCodec, register_device_codec

#: slots of the int64 ``info`` buffer: the radix state (threshold bits, ties
#: wanted), the NaN/Inf count; per-block counts follow from INFO_COUNTS
INFO_BITS, INFO_REM, INFO_BAD, INFO_COUNTS = 0, 1, 2, 4


def sample_start(n: int, s: int, key, counter: int) -> int:
    """The first sampled index of :func:`hpccomm.kernels.sparsify.strided_sample_abs`
    (the same expression on the same values)."""
    stride = n // s
    return int(hash_index_cpu(key, np.uint64(counter)) % np.uint64(stride))


class _Selection:
    """One selection over the device vector ``v``: its buffers and steps."""

    def __init__(self, dev: "PairDevice", v, info, scan: bool):
        self.dev, self.v, self.info, self.scan = dev, v, info, scan
        self.n = v.size
        self.k = dev.codec.max_count(self.n)
        self.idt = index_dtype(self.n)
        #: the threshold as the kernels read it (the low half of info[0])
        self.tf = info.view(np.float32)[0:1]

    def radix(self, bits, k):
        """The ``k``-th largest magnitude of the float32 bit patterns ``bits``
        into ``info[0]`` (the threshold) and its ties in the top ``k`` into ``info[1]``."""
        G.radix_select(bits, k, self.info, self.dev.scratch("hist", G.RADIX_BINS, np.int64))

    def sample(self, s, key, counter):
        """The ``s`` strided magnitude patterns of ``v`` (device scratch)."""
        out = self.dev.scratch("sample", s, np.uint32)
        G.gather_strided(self.v.view(np.uint32), sample_start(self.n, s, key, counter),
                         self.n // s, out)
        return out

    def set_threshold(self, t):
        U.fill(self.tf, np.float32(t))

    def count(self, vals=None):
        """Count ``vals`` (default ``v``) above / tied with the threshold;
        returns ``(t, counts)`` on the host.  The first call raises
        NonFiniteError when the scan found NaN/Inf."""
        vals = self.v if vals is None else vals
        blocks = G.run_tiles(vals.size)
        G.count_classes(vals, self.tf, self.info[INFO_COUNTS:INFO_COUNTS + 2 * blocks])
        host = U.to_host(self.info[:INFO_COUNTS + 2 * blocks])
        if self.scan:
            self.scan = False
            self.dev.raise_nonfinite(int(host[INFO_BAD]))
        t = host[:1].view(np.float32)[0]
        return t, host

    @staticmethod
    def candidates(host) -> int:
        return int(host[INFO_COUNTS:].sum())

    def finish(self, host):
        """The packet of the candidates counted in ``host`` (the last
        :meth:`count` over ``v``), cut to the ``k`` largest."""
        dev, n, k = self.dev, self.n, self.k
        m, compact = G.compact_classes(self.v, None, self.tf, G.ALL, host[INFO_COUNTS:])
        if m <= k:
            packet, idx, vals = dev.new_pairs(n, m)
            compact(idx, vals)
            return packet
        cidx = dev.scratch("cand_idx", m, self.idt)
        cvals = dev.scratch("cand_vals", m, np.float32)
        compact(cidx, cvals)
        self.radix(cvals.view(np.uint32), k)
        _, host = self.count(cvals)
        q = int(host[INFO_REM])
        kept, trim = G.compact_classes(cvals, cidx, self.tf, q, host[INFO_COUNTS:])
        if kept != k:  # pragma: no cover - the radix select's invariant
            raise RuntimeError(f"{dev.codec.name}: device selection kept {kept} of {k}")
        packet, idx, vals = dev.new_pairs(n, k)
        trim(idx, vals)
        return packet


class PairDevice(DeviceCodec):
    """Common part of the ``topk`` and ``dgc`` twins: the pair packet, error
    feedback and the owner step (see the module docstring).  Subclasses
    implement :meth:`_select` (the packet of ``v`` from a :class:`_Selection`)."""

    host = PairCodec

    # -- packets -------------------------------------------------------------
    def new_pairs(self, n: int, m: int):
        """A packet for ``m`` entries of ``n`` elements (header written) and
        its index / value views."""
        packet = self.new_packet(pairs_size(n, m), n, extra=m)
        return (packet,) + self._views(packet, n, m)

    @staticmethod
    def _views(packet, n: int, m: int):
        b = index_dtype(n).itemsize
        cut = HEADER_SIZE + b * m
        return (packet[HEADER_SIZE:cut].view(index_dtype(n)),
                packet[cut:cut + 4 * m].view(np.float32))

    def _header_error(self, packet, n: int):
        """Raise the host codec's PacketError for the header of ``packet``."""
        size = packet.size
        head = U.to_host(packet[:min(size, HEAD_BYTES)]) if size else np.empty(0, np.uint8)
        self.codec.check_header(head, n, size)
        raise PacketError(f"{self.codec.name}: malformed packet header")  # pragma: no cover

    def _entries(self, packet, n: int) -> int:
        """The entry count implied by the size of ``packet`` (header
        faults, and more than ``k`` entries, raise as the host does)."""
        body = packet.size - HEADER_SIZE
        width = index_dtype(n).itemsize + 4
        if body < 0 or body % width or body // width > self.codec.max_count(n):
            self._header_error(packet, n)
        return body // width

    def _validated(self, packets, n: int):
        """``[(m, idx, vals)]`` of received ``packets`` for ``n`` elements,
        every one checked on the device (one int32 per packet back) before
        anything is written; raises PacketError as the host decoder does,
        for the first bad packet."""
        metas = []
        for packet in packets:
            m = self._entries(packet, n)
            metas.append((m,) + self._views(packet, n, m))
        if not metas:
            return metas
        flags = U.fill(self.scratch("flags", len(metas), np.int32), 0)
        for slot, (packet, (m, idx, _)) in enumerate(zip(packets, metas)):
            G.check_pairs(packet, idx, n, m, self.codec.version, self.codec.codec_id, flags, slot)
        for packet, flag in zip(packets, U.to_host(flags)):
            if flag & 1:
                self._header_error(packet, n)
            if flag & 2:
                raise PacketError(f"{self.codec.name}: indices are not strictly increasing "
                                  f"inside [0, {n})")
        return metas

    def _decode_into(self, packet, out, add=False, subtract=False):
        ((m, idx, vals),) = self._validated([packet], out.size)
        if not (add or subtract):
            G.fill_runs(out, 0.0)
        G.scatter_runs(out, idx, vals, 1 if add else 2 if subtract else 0)

    def _own_entries(self, packet, n: int):
        m = (packet.size - HEADER_SIZE) // (index_dtype(n).itemsize + 4)
        return self._views(packet, n, m)

    # -- encoding --------------------------------------------------------------
    def _start(self, n: int):
        """The ``info`` buffer of one selection, its fixed slots zeroed."""
        info = self.scratch("info", INFO_COUNTS + 2 * G.run_tiles(n), np.int64)
        U.fill(info[:INFO_COUNTS], 0)
        return info

    def _scan(self, ctx, finite: bool) -> bool:
        return not (finite or self.codec.nonfinite != "raise")

    def _encode(self, v, ctx):
        info = self._start(v.size)
        scan = self._scan(ctx, ctx.finite) and v.size > 0
        if scan:
            G.compensate(v, None, None, info)
        return self._select(_Selection(self, v, info, scan), ctx)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """One compensate pass (``v = x + e`` into ``e_out``, or scratch
        without ``e_out``, with the NaN/Inf count), the selection, and the
        residual at the sent entries only."""
        n = x.size
        if e_out is None:
            v = x if e is None else self.scratch("v", n)
            finite = ctx.finite
        else:
            v = e_out
            finite = ctx.finite and e is None
        scan = self._scan(ctx, finite) and n > 0
        info = self._start(n)
        if v is not x or scan:
            G.compensate(x, e, None if v is x else v, info)
        ectx = replace(ctx, fresh=x) if ctx.feedback and e_out is not None else ctx
        packet = self._select(_Selection(self, v, info, scan), ectx)
        if e_out is not None:
            idx, vals = self._own_entries(packet, n)
            G.scatter_runs(e_out, idx, vals, 2)
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        n = out.size
        metas = self._validated(received, n)
        G.fill_runs(out, 0.0)                       # acc, formed in out
        for m, idx, vals in metas:                  # rank order, one launch each
            G.scatter_runs(out, idx, vals, 1)
        if e is not None:
            w = e_out if e_out is not None else self.scratch("w", n)
        else:
            w = e_out if e_out is not None else out
        scan = self._scan(ctx, ctx.finite) and n > 0
        info = self._start(n)
        if w is not out or scan:
            G.compensate(out, e, None if w is out else w, info)
        packet = self._select(_Selection(self, w, info, scan), ctx)
        idx, vals = self._own_entries(packet, n)
        if e_out is not None:
            G.scatter_runs(e_out, idx, vals, 2)
        G.fill_runs(out, 0.0)
        G.scatter_runs(out, idx, vals, 0)
        return packet

    def _select(self, sel: _Selection, ctx):
        raise NotImplementedError


@register_device_codec("topk")
class TopKDevice(PairDevice):
    """``topk``: the sampled threshold, candidates, the exact top-k cut."""

    host = TopK

    def _select(self, sel, ctx):
        codec, n, k = self.codec, sel.n, sel.k
        if k == 0:
            return self.new_pairs(n, 0)[0]
        s = codec.sample_size(n)
        sampled = False
        if k == n:
            sel.set_threshold(0.0)
        elif s == n:
            sel.radix(sel.v.view(np.uint32), k)
        else:
            key = stream_key(ctx.seed, ctx.rank, ctx.step, SALT)
            sel.radix(sel.sample(s, key, ctx.offset), min(s, math.ceil(MARGIN * codec.ratio * s)))
            sampled = True
        t, host = sel.count()
        if codec.exact and sampled and sel.candidates(host) < k and t > 0:
            sel.radix(sel.v.view(np.uint32), k)
            t, host = sel.count()
        return sel.finish(host)
