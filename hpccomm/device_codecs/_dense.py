"""The host side shared by the twins of the dense quantizing codecs (fp16,
bf16, onebit, terngrad, qsgd): building the *source* their fused kernels
read (:mod:`hpccomm.kernels.cuda_quantize`), the NaN/Inf counter, decoding.

Every twin runs the encoder and the owner step through one method,
``_code(src, n, e_out, out, ctx, count)``: the source is ``v = x + e`` for
:meth:`encode_with_feedback` and ``w = (0 + decode(p0) + decode(p1) + ...)
+ e`` for :meth:`owner_step`, whose packets the kernels decode as they read
them (the last :data:`~hpccomm.kernels.cuda_quantize.GROUP` of them; the
ones before are summed into ``out`` first, one grid-stride pass per group,
in rank order).  The NaN/Inf count comes back to the host (one integer)
only under ``nonfinite="raise"``; it is taken where the base class's
three-step path checks.
"""
from __future__ import annotations

import numpy as np

from ..kernels import cuda_quantize as Q
from ..kernels import cuda_util as U
from .base import DeviceCodec


class DenseDevice(DeviceCodec):
    """A twin whose kernels read a source (see the module docstring).
    Subclasses set ``_decode_kernel`` / ``_presum_kernel`` (kernels of
    :mod:`~hpccomm.kernels.cuda_quantize`, wrapped in ``staticmethod``: a
    numba.cuda dispatcher read from an instance binds to it like a function),
    :meth:`_views` and ``_code``."""

    _decode_kernel = None
    _presum_kernel = None

    def _views(self, packet):
        """The two views of ``packet`` its kernels decode from."""
        raise NotImplementedError

    def _flag(self) -> bool:
        return False

    def _code(self, src, n, e_out, out, ctx, count):
        """The packet of the source's ``n`` values; ``e_out = v - decode``
        and ``out = decode`` (those not None); raises for NaN/Inf with
        ``count``."""
        raise NotImplementedError

    # -- sources ---------------------------------------------------------------
    def _slots(self, views, base, has_base, e):
        """A source's 14 kernel arguments: ``views`` (at most GROUP packets)
        padded with the first (or an unread dummy)."""
        pad = views[0] if views else self._views(self.scratch("nopacket", 16, np.uint8))
        slots = list(views) + [pad] * (Q.GROUP - len(views))
        flat = [a for ab in slots for a in ab]
        return (base, has_base, *flat, len(views), self._flag(),
                base if e is None else e, e is not None)

    def _input(self, x, e):
        """The encoder's source ``v = x + e`` (``x`` for ``e=None``)."""
        return self._slots([], x, True, e)

    def _received(self, received, e, out):
        """The owner's source: the received packets summed in rank order,
        ``+ e``; packets before the last group are summed into ``out`` now."""
        views = [self._views(p) for p in received]
        last = len(views) - ((len(views) - 1) % Q.GROUP + 1) if views else 0
        for g in range(0, last, Q.GROUP):
            src = self._slots(views[g:g + Q.GROUP], out, g > 0, None)
            Q.launch_grid(self._presum_kernel, out.size, *src, out)
        return self._slots(views[last:], out, last > 0, e)

    # -- NaN/Inf ----------------------------------------------------------------
    def _counting(self, n, checked) -> bool:
        return n > 0 and self.codec.nonfinite == "raise" and not checked

    def _counter(self, count):
        bad = self.scratch("bad", 1, np.int64)
        if count:
            U.fill(bad, 0)
        return bad

    def _check(self, bad, count):
        if count:
            self.raise_nonfinite(int(U.to_host(bad)[0]))

    @staticmethod
    def _outputs(src, e_out, out):
        """``(e_out, has_eout, out, has_out)`` kernel arguments (an unwritten
        float32 array stands in for None)."""
        dummy = src[0]
        return (dummy if e_out is None else e_out, e_out is not None,
                dummy if out is None else out, out is not None)

    # -- the contract -------------------------------------------------------------
    def encode_with_feedback(self, x, e, e_out, ctx):
        checked = ctx.finite if e_out is None else (ctx.finite and e is None)
        return self._code(self._input(x, e), x.size, e_out, None, ctx,
                          self._counting(x.size, checked))

    def owner_step(self, received, e, e_out, out, ctx):
        return self._code(self._received(received, e, out), out.size, e_out, out, ctx,
                          self._counting(out.size, ctx.finite))

    def _encode(self, v, ctx):
        return self._code(self._input(v, None), v.size, None, None, ctx, False)

    def _decode_into(self, packet, out, add=False, subtract=False):
        a, b = self._views(packet)
        Q.launch_grid(self._decode_kernel, out.size, a, b, self._flag(), out,
                      1 if add else 2 if subtract else 0)
