"""Compressed allreduce of device buffers: encode, owner step and decode run
on the device; only packets leave it.

For device input (CuPy, torch CUDA, any ``__cuda_array_interface__``) the
reducer hands the call here when the codec has a device twin
(:mod:`hpccomm.device_codecs`), the memory is ``none`` or ``residual``, the
dtype is float32 and the algorithm is ``twoshot`` or ``allgather`` (or
``auto`` choosing one of them).  The steps are those of
:mod:`hpccomm.collectives.twoshot` and :mod:`hpccomm.collectives.allgather`,
with the same bits on every rank and the same bits as the host path:

1. Chunk bounds and fixed packet sizes as the host algorithm plans them.
2. Every rank encodes its chunks on the device with error feedback fused
   (``DeviceCodec.encode_with_feedback``; residuals live on the device, in
   the key's state under the slots ``device:worker`` / ``device:owner``).
3. The packets go to MPI: with CUDA-aware MPI (``gpu_aware``) from device
   memory (one device buffer of all chunk packets, ``MPI_Alltoallv``);
   otherwise each is copied once into reused pinned host memory, sent, and the
   received packets are copied once back to the device.  The leading bytes
   of every received packet are checked on the host
   (:meth:`~hpccomm.codecs.base.Codec.check_header`) before a kernel reads it.
4. ``twoshot``: the owner step on the device (decode-sum in rank order,
   owner residual, re-encode, this rank's slice of the result), one
   ``MPI_Allgatherv`` of the owner packets, every other chunk decoded on the
   device.  ``allgather``: one ``MPI_Allgatherv`` of the whole packets, all
   decoded and added in rank order.
5. ``op="mean"`` divides on the device.

Every kernel and copy runs on the input's GPU (its primary context made
current on the calling thread, the progress thread of ``start()`` included)
and on the stream that produced the input (``ctx.where``, a
:class:`~hpccomm.buffers.Placement` the reducer took on the caller's
thread); the stream is synchronized only where the host or MPI reads what
it wrote.  The pipeline's buffers -- the twin's scratch, the device work
buffers, the pinned staging, the residuals -- outlive a call: a call on
another stream than the last one first makes its stream wait (on the
device, an event the last call recorded) for all the last call did, so
nothing is overwritten while an earlier stream still reads it.  Host traffic per call
(``CallStats.extra``: ``staged_d2h`` / ``staged_h2d``, bytes) is the packets
and nothing else: ``sum of this rank's chunk packets + its owner packet`` to
the host and ``received + gathered packets`` back (twoshot), or ``its packet``
and ``all P packets`` (allgather); with ``gpu_aware`` only the checked
headers (:data:`~hpccomm.codecs.base.HEAD_BYTES` per received packet).
Device-side selection steps of some twins copy small arrays of their own
(a sample, histograms); they count in ``staged_select``.

Not here (the reducer stages the whole gradient through the host instead, and
says so in ``CallStats.extra["staged"] = "gradient"``): codecs without a
twin, the ``dgc`` momentum memory, float16/bfloat16/float64 device input, the
summable, hierarchical and sparse algorithms.  ``twoshot``'s segments do not
apply on the device (one segment).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..codecs.base import HEAD_BYTES, Codec
from ..memory import Memory
from .base import Algorithm

#: algorithms whose steps run on the device
DEVICE_ALGORITHMS = ("twoshot", "allgather")
#: byte alignment of every packet in the pipeline's device buffers
ALIGN = 8


def why_not_on_device(algorithm: Algorithm, codec: Codec, memory: Memory, dtype: str) -> str:
    """Why a call cannot run on the device ("" when it can; ``auto`` is
    decided per call by :class:`DevicePath`)."""
    if dtype != "float32":
        return f"dtype {dtype} (the device path reduces float32)"
    if algorithm.name not in DEVICE_ALGORITHMS + ("auto",):
        return f"algorithm {algorithm.name!r} has no device path"
    if memory.enabled and not memory.fusable:
        return f"memory {memory.name!r} has no device path"
    from ..device_codecs import device_codec_class

    cls = device_codec_class(codec.name)
    if cls is None:
        return f"codec {codec.name!r} has no device twin"
    refused = cls.refuses(codec)
    if refused:
        return f"codec {codec.describe()}: {refused}"
    return ""


class DevicePath:
    """One reducer's device pipeline (see the module docstring)."""

    def __init__(self, algorithm: Algorithm, codec: Codec, staging, gpu_aware: bool, backend):
        from ..device_codecs import device_codec_for
        from ..kernels import cuda_util

        self.algorithm, self.codec = algorithm, codec
        self.twin = device_codec_for(codec)
        #: pinned host buffers of this pipeline alone (``HostStaging``), made by ``backend``
        self.staging, self.gpu_aware, self._backend = staging, gpu_aware, backend
        self.U = cuda_util
        self.rank, self.size = algorithm.rank, algorithm.size
        #: device work buffers of the exchanges, by name, kept between calls
        self._work = {}
        #: the placement of the last call and the event recorded at its end
        self._last_where = None
        self._done = None

    # -- the call ------------------------------------------------------------
    def choice(self, n: int, state, ctx) -> str:
        """The algorithm this call runs: the reducer's, or ``auto``'s decision
        (``"dense"``, or one it may take that has no device path)."""
        alg = self.algorithm
        if alg.name == "auto":
            return alg.decide(n, tuple(ctx.shape), ctx.key, ctx.net)
        return alg.name

    def reduce(self, x_obj, out_obj, state, ctx, choice: str, mean: bool) -> None:
        """Sum ``x_obj`` over the ranks into ``out_obj`` (device buffers of
        float32, on ``ctx.where``) along ``choice`` (``twoshot`` or
        ``allgather``); ``mean``: then divide by the number of ranks."""
        U = self.U
        with U.on_device(*ctx.where) as stream:
            if self._done is not None and self._last_where != ctx.where:
                self._done.wait(stream)        # the last call's stream first (its buffers)
            try:
                x, out = U.as_kernel_array(x_obj), U.as_kernel_array(out_obj)
                call = ctx.call
                call.extra.update(staged="packets", staged_d2h=0, staged_h2d=0)
                call.nbytes = 4 * x.size
                if choice == "twoshot":
                    self._twoshot(x, out, state, ctx)
                else:
                    self._allgather(x, out, state, ctx)
                if mean and self.size > 1:
                    U.divide(out, self.size)
                call.extra["staged_select"] = getattr(self.twin, "host_bytes", 0)
            finally:
                if self._done is None:
                    self._done = U.event()
                self._done.record(stream)
                self._last_where = ctx.where

    def to_host(self, a) -> np.ndarray:
        """A host copy of device array ``a`` of this pipeline (a residual for
        ``state_dict``), read on the last call's stream: after it."""
        with self.U.on_device(*self._last_where):
            return self.U.to_host(a)

    def _buffers(self, memory: Memory, state, slot: str, n: int):
        """``(e, e_out)`` of ``slot`` on the device (None, None without memory);
        a residual loaded from a state dict (host memory) moves to the device
        once."""
        if not memory.enabled:
            return None, None
        e, e_out = memory.fused_buffers(state, slot, n, empty=lambda k: self.U.empty(k, np.float32))
        if isinstance(e, np.ndarray):
            e = state.residuals[slot] = self.U.to_device(e)
        return e, e_out

    @staticmethod
    def _part(a, lo: int, hi: int):
        return None if a is None else a[lo:hi]

    def _encode(self, x, e, e_out, bounds, ctx) -> list:
        twin, r = self.twin, self.rank
        with ctx.call.time("encode"):
            return [twin.encode_with_feedback(x[lo:hi], self._part(e, lo, hi),
                                              self._part(e_out, lo, hi),
                                              ctx.encode_context(r, lo))
                    for lo, hi in zip(bounds[:-1], bounds[1:])]

    def _twoshot(self, x, out, state, ctx) -> None:
        """Steps 1-4 of ``twoshot`` (its module docstring)."""
        twin, call, P, r, n = self.twin, ctx.call, self.size, self.rank, x.size
        memory = ctx.memory
        if P == 1:
            bounds, fixed = [0, n], None
        else:
            bounds, fixed = self.algorithm_for("twoshot").chunk_plan(n, ctx.shape, state)
        e, e_out = self._buffers(memory, state, "device:worker", n)
        packets = self._encode(x, e, e_out, bounds, ctx)
        if P == 1:
            with call.time("decode"):
                twin.decode(packets[0], out)
        else:
            lo, hi = bounds[r], bounds[r + 1]
            received = self._alltoallv(packets, None if fixed is None else [fixed[r]] * P,
                                       hi - lo, ctx)
            owner = memory.owner
            eo, eo_out = self._buffers(owner, state, "device:owner", hi - lo)
            with call.time("encode"):
                mine = twin.owner_step(received, eo, eo_out, out[lo:hi],
                                       ctx.encode_context(P + r, lo))
            lengths = [bounds[j + 1] - bounds[j] for j in range(P)]
            gathered = self._allgatherv(mine, fixed, lengths, ctx)
            with call.time("decode"):
                for j in range(P):
                    if j != r:
                        twin.decode(gathered[j], out[bounds[j]:bounds[j + 1]])
            if owner.enabled:
                owner.commit_fused(state, "device:owner")
        if memory.enabled:
            memory.commit_fused(state, "device:worker")

    def _allgather(self, x, out, state, ctx) -> None:
        """``allgather``: encode once, gather every packet, decode-add in rank order."""
        twin, call, P, n = self.twin, ctx.call, self.size, x.size
        memory = ctx.memory
        e, e_out = self._buffers(memory, state, "device:worker", n)
        packet, = self._encode(x, e, e_out, [0, n], ctx)
        if P == 1:
            with call.time("decode"):
                twin.decode(packet, out)
        else:
            size = self.codec.wire_size_for(n, ctx.shape)
            gathered = self._allgatherv(packet, None if size is None else [size] * P,
                                        [n] * P, ctx)
            with call.time("decode"):
                self.U.fill(out, 0.0)
                for src in range(P):
                    twin.decode(gathered[src], out, add=True)
        if memory.enabled:
            memory.commit_fused(state, "device:worker")

    def algorithm_for(self, name: str) -> Algorithm:
        alg = self.algorithm
        return alg.candidate(name) if alg.name == "auto" else alg

    # -- packets across ------------------------------------------------------
    def _check(self, heads: List[np.ndarray], sizes: List[int], lengths: List[int]) -> None:
        """The host check of every received packet's header and size."""
        for head, size, m in zip(heads, sizes, lengths):
            self.codec.check_header(head, m, size)

    @staticmethod
    def _aligned(counts: List[int]) -> List[int]:
        """Offsets of packets of ``counts`` bytes laid out one after the other
        in device memory, each at a multiple of :data:`ALIGN` bytes (the
        twins read payloads through typed views: a float32 or int64 field at
        an odd address faults on a GPU)."""
        offsets, off = [], 0
        for c in counts:
            offsets.append(off)
            off += -(-c // ALIGN) * ALIGN
        return offsets + [off]

    def _device_views(self, dev, counts: List[int], offsets: List[int]) -> list:
        return [dev[o:o + c] for o, c in zip(offsets, counts)]

    def _scratch(self, name: str, nbytes: int):
        buf = self._work.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._work[name] = self.U.empty(max(nbytes, 1), np.uint8)
        return buf[:nbytes]

    def _to_host(self, packets: list, slot: str, call) -> List[np.ndarray]:
        """The packets copied into one pinned host buffer, as views."""
        sizes = [int(p.size) for p in packets]
        host = self.staging.get(slot, sum(sizes), self._backend)
        views, off = [], 0
        with call.time("comm"):
            for p, c in zip(packets, sizes):
                view = host[off:off + c]
                if c:
                    self.U.to_host(p, view, wait=False)
                views.append(view)
                off += c
            self.U.synchronize()                 # one wait for all of them
        call.extra["staged_d2h"] += sum(sizes)
        return views

    def _to_device(self, received, slot: str, call) -> list:
        """Received host packets copied to the device (one copy each, to
        aligned offsets), as packet views."""
        counts = [int(p.size) for p in received]
        offsets = self._aligned(counts)
        dev = self._scratch(slot, offsets[-1])
        views = self._device_views(dev, counts, offsets)
        with call.time("comm"):
            for view, packet in zip(views, received):
                if packet.size:
                    self.U.from_host(packet, view)
        call.extra["staged_h2d"] += sum(counts)
        return views

    def _heads(self, dev_packets: list, call) -> List[np.ndarray]:
        """The leading bytes of device packets, for the header check."""
        return self._to_host([p[:min(HEAD_BYTES, int(p.size))] for p in dev_packets], "heads",
                             call)

    def _alltoallv(self, packets: list, recv_sizes: Optional[List[int]], m: int, ctx) -> list:
        net, call, P = ctx.net, ctx.call, self.size
        if not self.gpu_aware:
            host = self._to_host(packets, "send", call)
            received = net.alltoallv(host, recv_sizes,
                                     recv_buffer=lambda k: self.staging.get("recv", k,
                                                                            self._backend))
            self._check(list(received), [p.size for p in received], [m] * P)
            return self._to_device(received, "recv", call)
        send_counts = [int(p.size) for p in packets]
        send_offsets = self._aligned(send_counts)
        sendbuf = self._scratch("send", send_offsets[-1])
        for view, p in zip(self._device_views(sendbuf, send_counts, send_offsets), packets):
            self.U.copy(p, view)
        recv_counts = (net.alltoall_counts(send_counts) if recv_sizes is None
                       else [int(c) for c in recv_sizes])
        recv_offsets = self._aligned(recv_counts)
        recvbuf = self._scratch("recv", recv_offsets[-1])
        self.U.synchronize()                 # MPI reads what the kernels wrote
        net.alltoallv_device(self.U.mpi_buffer(sendbuf), send_counts, send_offsets[:-1],
                             self.U.mpi_buffer(recvbuf), recv_counts, recv_offsets[:-1])
        views = self._device_views(recvbuf, recv_counts, recv_offsets)
        self._check(self._heads(views, call), recv_counts, [m] * P)
        return views

    def _allgatherv(self, packet, sizes: Optional[List[int]], lengths: List[int], ctx) -> list:
        net, call = ctx.net, ctx.call
        if not self.gpu_aware:
            host, = self._to_host([packet], "owner", call)
            gathered = net.allgatherv(host, sizes,
                                      recv_buffer=lambda k: self.staging.get("gathered", k,
                                                                             self._backend))
            self._check(list(gathered), [p.size for p in gathered], lengths)
            return self._to_device(gathered, "gathered", call)
        counts = net.allgather_counts(int(packet.size)) if sizes is None else list(sizes)
        offsets = self._aligned(counts)
        recvbuf = self._scratch("gathered", offsets[-1])
        self.U.synchronize()
        net.allgatherv_device(self.U.mpi_buffer(packet), self.U.mpi_buffer(recvbuf), counts,
                              offsets[:-1])
        views = self._device_views(recvbuf, counts, offsets)
        self._check(self._heads(views, call), counts, lengths)
        return views
