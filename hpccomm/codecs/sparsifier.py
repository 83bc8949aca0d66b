"""Helpers shared by the sparsifying codecs (threshold, adaptive, topk, randk,
dgc): the base class, index widths, exact "fraction of n" counts and aligned
payload views.

Every sparsifier also offers :meth:`SparseCodec.sparsify`, the ``(indices,
values)`` pairs its packet would carry -- what the sparse allreduce algorithms
(:mod:`hpccomm.collectives.sparse.base`) reduce instead of packets.  The pairs
are exactly the entries ``decode(encode(x))`` writes.
"""
from __future__ import annotations

import functools
from fractions import Fraction
from typing import Optional, Tuple

import numpy as np

from ..errors import PacketError
from .base import Codec, EncodeContext

#: entry counts travel in the header's uint32 ``extra`` field
COUNT_MAX = 2 ** 32 - 1
#: vectors this long or longer use 64-bit indices / words
WIDE_N = 2 ** 31


def index_dtype(n: int) -> np.dtype:
    """int32 indices below ``2**31`` elements, int64 from there on."""
    return np.dtype(np.int32) if n < WIDE_N else np.dtype(np.int64)


def fraction_count(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` computed exactly on the decimal value the user
    wrote (``repr`` of the float), so ``0.07`` of 100 is 7, not 8."""
    num, den = _decimal_ratio(float(fraction))
    return -(-num * int(n) // den)


@functools.lru_cache(maxsize=256)
def _decimal_ratio(fraction: float) -> Tuple[int, int]:
    """``fraction``'s decimal ``repr`` as ``(numerator, denominator)``, kept:
    a sparsifier asks for its counts several times per call, and parsing
    the decimal took 5 us each time."""
    exact = Fraction(repr(fraction))
    return exact.numerator, exact.denominator


def check_fraction(name: str, value: float) -> float:
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], not {value!r}")
    return value


def payload_view(packet: np.ndarray, offset: int, dtype, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` at byte ``offset`` of ``packet`` (uint8),
    copied when the address is not aligned for ``dtype`` (packets received
    into one MPI buffer sit at arbitrary byte offsets).  The caller has
    checked that the bytes exist."""
    dtype = np.dtype(dtype)
    arr = packet[offset:offset + count * dtype.itemsize].view(dtype)
    return arr if arr.flags.aligned else arr.copy()


def check_count(codec: Codec, count: int, bound: int, n: int) -> None:
    """PacketError unless ``count <= bound``."""
    if count > bound:
        raise PacketError(f"{codec.name}: packet announces {count} entries, more than the "
                          f"{bound} that {n} elements allow")


class SparseCodec(Codec):
    """Base of the sparsifying codecs: variable size, biased (error feedback
    on by default), and able to hand out its selection as pairs."""

    fixed_size = False
    biased = True

    def sparsify(self, x: np.ndarray,
                 ctx: EncodeContext = EncodeContext()) -> Tuple[np.ndarray, np.ndarray]:
        """``(indices, values)``: strictly increasing indices (:func:`index_dtype`)
        and float32 values of the entries ``decode(encode(x, ctx))`` sets; every
        other element decodes to zero."""
        return self._pairs(self._check_input(x), ctx)

    def _pairs(self, x: np.ndarray, ctx: EncodeContext) -> Tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    # -- kernels on slots laid out once (twoshot's plan of a repeated small
    # call): a codec that has them names the method that says where they
    # apply (SLOT_RULE) and the steps they stand for (SLOT_STANDS_FOR), and
    # offers slot_views(slot, n, shape), row_views(slots, n, shape),
    # encode_slot(views, x, e, e_out, draw), owner_slot(rows, entries, e,
    # e_out, out, views, draw) and decode_slot(row, entries, out); ``draw``
    # (a Draw) is what a stochastic one reads of the call (SLOT_DRAWS)
    SLOT_RULE = ""
    SLOT_STANDS_FOR: Tuple[str, ...] = ()
    SLOT_DRAWS = False

    def slot_count(self, n: int, shape: Optional[tuple] = None):
        """The entries a slot of ``n`` elements of a tensor of ``shape``
        holds where this codec's slot kernels apply (its
        :attr:`SLOT_RULE`), else None -- also for a subclass that overrides
        one of :attr:`SLOT_STANDS_FOR` below the class that gives the rule
        (its own steps then run)."""
        if not self.SLOT_RULE:
            return None
        cls = type(self)
        base = next(c for c in cls.__mro__ if self.SLOT_RULE in c.__dict__)
        if any(getattr(cls, name) is not getattr(base, name) for name in self.SLOT_STANDS_FOR):
            return None
        return getattr(self, self.SLOT_RULE)(n, shape)
