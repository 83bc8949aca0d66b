"""Codecs on device arrays: the packets of :mod:`hpccomm.codecs`, made and
read by ``numba.cuda`` kernels.

A :class:`DeviceCodec` wraps a host codec instance -- its parameters, header,
sizes and header validation stay the host codec's -- and does on flat device
arrays what the host codec does on numpy arrays::

    encode_with_feedback(x, e, e_out, ctx) -> packet
        the packet of v = x + e (v = x for e=None) and e_out = v - decode(packet);
        e_out=None: no residual, the packet of x
    owner_step(received, e, e_out, out, ctx) -> packet
        twoshot's step 4: acc = the decoded received packets summed in rank
        order (from zero), w = acc + e, its packet (the host codec's
        ``reencode``), e_out = w - decode(packet), out = decode(packet)
    decode(packet, out, add=False)

The contract is the host codec's three-step reference, bit for bit: the
packet's bytes equal ``codec.encode(v, ctx')`` with ``ctx'`` = ``ctx`` plus
``fresh=x`` when ``ctx.feedback`` (``fresh=acc`` at the owner), decoded values
equal ``codec.decode``, and a NaN/Inf in ``v`` raises
:class:`~hpccomm.errors.NonFiniteError` under ``nonfinite="raise"`` (unless
``ctx.finite``) before anything is sent.  Where the host's fused kernels
(``Codec.encode_with_feedback`` / ``owner_step``) exist they give these very
bits too, so CPU and GPU ranks may be mixed.

Arrays are numba device arrays (``DeviceNDArray``; under
``NUMBA_ENABLE_CUDASIM=1`` the simulator's ``FakeCUDAArray``): ``x``, ``e``,
``e_out``, ``out`` flat float32; packets flat uint8.  Received packets have
had their headers validated on the host (:meth:`Codec.check_header
<hpccomm.codecs.base.Codec.check_header>`); what the host codec validates in
its payload (sparse indices, counts) the device codec validates on the device
before writing anything, raising the same :class:`~hpccomm.errors.PacketError`.
Kernels run on the stream of :func:`hpccomm.kernels.cuda_util.current_stream`.

Importing this package imports numba.cuda: ``import hpccomm`` does not.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Type

import numpy as np

from ..codecs.base import HEADER_SIZE, Codec, EncodeContext
from ..codecs.none import NoneCodec
from ..errors import NonFiniteError
from ..kernels import cuda_util as U


class DeviceCodec:
    """The device twin of one host codec class (see the module docstring).

    Subclasses implement :meth:`_encode` (``v`` on the device, its packet),
    :meth:`_decode_into` and, where the host codec's decoded sums take a
    shortcut (``reencode``), :meth:`_reencode`.  The base class composes them
    into the three-step forms; subclasses override
    :meth:`encode_with_feedback` / :meth:`owner_step` with fused kernels
    where that saves passes."""

    #: the host codec class this twin serves (set by subclasses)
    host: Type[Codec] = Codec

    @classmethod
    def refuses(cls, codec: Codec) -> str:
        """Why this twin cannot serve the host instance ``codec`` (a variant
        of its layout it does not make), or "" when it can."""
        return ""

    def __init__(self, codec: Codec):
        self.codec = codec
        self._scratch: Dict[str, object] = {}

    # -- helpers ------------------------------------------------------------
    def scratch(self, name: str, n: int, dtype=np.float32):
        """A device work buffer of ``n`` elements kept between calls."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = self._scratch[name] = U.empty(max(n, 1), dtype)
        return buf[:n]

    def new_packet(self, nbytes: int, n: int, extra: int = 0):
        """A device packet of ``nbytes`` with the common header written (on
        the device, from kernel arguments) and its payload uninitialised."""
        packet = U.empty(nbytes, np.uint8)
        U.write_header(packet, self.codec.version, self.codec.codec_id, extra, n)
        return packet

    def raise_nonfinite(self, bad: int) -> None:
        """Raise as the host codec does for ``bad`` NaN/Inf values."""
        if bad and self.codec.nonfinite == "raise":
            raise NonFiniteError(f"{self.codec.name}: input holds {bad} NaN/Inf value(s) "
                                 "(policy nonfinite='raise')")

    def check_finite(self, v, ctx: EncodeContext) -> None:
        """The host codec's input scan, on the device: one reduction and one
        integer back to the host."""
        if ctx.finite or self.codec.nonfinite != "raise" or v.size == 0:
            return
        self.raise_nonfinite(U.count_nonfinite(v))

    # -- the contract -----------------------------------------------------------
    def encode_with_feedback(self, x, e, e_out, ctx: EncodeContext):
        if e_out is None:
            v = x if e is None else U.add(x, e, self.scratch("v", x.size))
            self.check_finite(v, ctx)
            return self._encode(v, ctx)
        if e is None:
            U.copy(x, e_out)
        else:
            U.add(x, e, e_out)
        self.check_finite(e_out, replace(ctx, finite=ctx.finite and e is None))
        ectx = replace(ctx, fresh=x) if ctx.feedback else ctx
        packet = self._encode(e_out, ectx)
        self._decode_into(packet, e_out, add=False, subtract=True)
        return packet

    def owner_step(self, received: Sequence, e, e_out, out, ctx: EncodeContext):
        m = out.size
        acc = out                                   # the sum is formed in out
        U.fill(acc, 0.0)
        for packet in received:                     # rank order
            self._decode_into(packet, acc, add=True)
        if e is not None:
            w = U.add(acc, e, e_out if e_out is not None else self.scratch("w", m))
        elif e_out is not None:
            w = U.copy(acc, e_out)
        else:
            w = acc
        self.check_finite(w, ctx)
        octx = replace(ctx, fresh=U.copy(acc, self.scratch("acc", m))) \
            if e_out is not None and ctx.feedback else ctx
        packet = self._reencode(w, octx)
        if e_out is not None:
            self._decode_into(packet, e_out, add=False, subtract=True)
        self._decode_into(packet, out, add=False)
        return packet

    def decode(self, packet, out, add: bool = False):
        self._decode_into(packet, out, add=add)
        return out

    # -- to implement -------------------------------------------------------------
    def _encode(self, v, ctx: EncodeContext):
        """The packet of ``v`` (finite-checked already)."""
        raise NotImplementedError

    def _reencode(self, w, ctx: EncodeContext):
        """The owner's packet of ``w`` (the host codec's ``reencode``)."""
        return self._encode(w, ctx)

    def _decode_into(self, packet, out, add: bool = False, subtract: bool = False) -> None:
        """``out = decode(packet)``; ``add``: ``out += decode(packet)``;
        ``subtract``: ``out = out - decode(packet)`` (the residual ``e_out = v
        - decode``, one float32 subtraction per element)."""
        raise NotImplementedError


class NoneDevice(DeviceCodec):
    """``none``: the float32 values after the header."""

    host = NoneCodec

    def _encode(self, v, ctx):
        packet = self.new_packet(HEADER_SIZE + 4 * v.size, v.size)
        U.copy(v, packet[HEADER_SIZE:].view(np.float32))
        return packet

    def _decode_into(self, packet, out, add=False, subtract=False):
        values = packet[HEADER_SIZE:].view(np.float32)
        if add:
            U.add(out, values, out)
        elif subtract:
            U.subtract(out, values, out)
        else:
            U.copy(values, out)


#: host codec name -> module of hpccomm.device_codecs defining its twin
_MODULES = {
    "none": "base",
    "fp16": "halfwidth", "bf16": "halfwidth",
    "onebit": "onebit", "terngrad": "terngrad", "qsgd": "qsgd",
    "topk": "topk", "dgc": "dgc",
    "threshold": "threshold", "adaptive": "adaptive", "randk": "randk",
}
_TWINS: Dict[str, Type[DeviceCodec]] = {"none": NoneDevice}


def register_device_codec(name: str):
    """Class decorator: the device twin of host codec ``name``."""
    def deco(cls):
        _TWINS[name] = cls
        return cls
    return deco


def device_codec_class(name: str) -> Optional[Type[DeviceCodec]]:
    """The device twin of host codec ``name``, or None when it has none."""
    if name not in _TWINS and name in _MODULES:
        import importlib

        try:
            importlib.import_module(f"{__package__}.{_MODULES[name]}")
        except ModuleNotFoundError as exc:   # a twin not written yet
            if exc.name != f"{__package__}.{_MODULES[name]}":
                raise
    return _TWINS.get(name)


def device_codec_for(codec: Codec) -> Optional[DeviceCodec]:
    """A device twin of ``codec`` (same parameters), or None (none, or one
    that refuses this instance: :meth:`DeviceCodec.refuses`)."""
    cls = device_codec_class(codec.name)
    if cls is None or not isinstance(codec, cls.host) or cls.refuses(codec):
        return None
    return cls(codec)


def device_codec_names() -> List[str]:
    """Host codec names that have a device twin."""
    return [name for name in _MODULES if device_codec_class(name) is not None]

