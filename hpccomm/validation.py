"""Cross-rank agreement: errors found on one rank are raised on every rank.

A collective hangs when one rank raises before it and the others enter it.
hpccomm therefore validates locally *without raising*, then runs one small
``MPI_Allreduce`` (``int64[4]``, MAX) in which every rank reports

* whether it hit a local error, and which rank hit it first, and
* a 62-bit hash of a text that describes the call (length, dtype, codec with
  its parameters, algorithm, op).

If any rank failed, the first failing rank broadcasts its exception's class and
message and every rank raises the same exception with the same text.  If the
descriptions differ, every rank gathers them and raises the same
:class:`~hpccomm.errors.ConsistencyError` naming which ranks said what.  The
happy path costs one 32-byte allreduce.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Optional

import numpy as np
from mpi4py import MPI

from .errors import ConsistencyError, HpccommError, NonFiniteError, PacketError, RemoteError

_REBUILDABLE = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        IndexError,
        OverflowError,
        MemoryError,
        NotImplementedError,
        KeyError,
        RuntimeError,
        ConsistencyError,
        PacketError,
        NonFiniteError,
    )
}


@functools.lru_cache(maxsize=4096)
def description_hash(text: str) -> int:
    """A stable 62-bit hash of ``text`` (the same on every rank and run)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _rebuild(name: str, message: str) -> BaseException:
    cls = _REBUILDABLE.get(name)
    if cls is None:
        exc = RemoteError(f"{name}: {message}")
    elif cls is KeyError:
        exc = KeyError(message)
    else:
        exc = cls(message)
    return everywhere(exc)


def everywhere(exc: BaseException) -> BaseException:
    """``exc``, marked as raised on every rank alike: for an algorithm that
    decided collectively to raise it (e.g. after an allgather of local
    errors)."""
    exc.hpccomm_everywhere = True
    return exc


def raised_everywhere(exc: BaseException) -> bool:
    """Whether ``exc`` was raised on every rank alike: by :func:`agree`, or
    marked by :func:`everywhere`."""
    return getattr(exc, "hpccomm_everywhere", False)


def agree(comm: MPI.Comm, description: str, error: Optional[BaseException] = None) -> None:
    """Make every rank raise the same error, or none.

    ``description`` is a text that must be equal on every rank; ``error`` is the
    exception this rank caught while validating its own input (or ``None``).
    Collective over ``comm``; returns normally only when no rank failed and all
    descriptions are equal.
    """
    size = comm.Get_size()
    if size == 1:
        if error is not None:
            raise _rebuild(type(error).__name__, f"rank 0: {error}") from error
        return
    if error is None:
        flags = _passing_flags(description).copy()
    else:
        h = description_hash(description)
        flags = np.array([1, h, -h, size - comm.Get_rank()], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    failed, high, minus_low, first = flags.tolist()
    if failed:
        root = size - first
        payload = (type(error).__name__, str(error)) if comm.Get_rank() == root else None
        name, message = comm.bcast(payload, root=root)
        exc = _rebuild(name, f"rank {root}: {message}")
        if error is not None:
            raise exc from error
        raise exc
    if high != -minus_low:
        descriptions = comm.allgather(description)
        raise everywhere(ConsistencyError(explain_mismatch(descriptions)))


@functools.lru_cache(maxsize=4096)
def _passing_flags(description: str) -> np.ndarray:
    """:func:`agree`'s flags of a rank without error (read-only: copied per call)."""
    h = description_hash(description)
    flags = np.array([0, h, -h, 0], dtype=np.int64)
    flags.flags.writeable = False
    return flags


def explain_mismatch(descriptions) -> str:
    """Name the fields that differ and which ranks passed which value.

    Descriptions are space-separated ``field=value`` tokens."""
    token_lists = [d.split(" ") for d in descriptions]
    common = set(token_lists[0]).intersection(*token_lists[1:])
    groups: dict = {}
    for r, tokens in enumerate(token_lists):
        diff = " ".join(t for t in tokens if t not in common) or "(same)"
        groups.setdefault(diff, []).append(r)
    parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {d}"
                      for d, rs in groups.items())
    same = " ".join(t for t in token_lists[0] if t in common)
    return f"ranks called the collective with different arguments: {parts} (all: {same})"


def _ranges(ranks):
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start, prev = [], None, None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


def check_local(fn, *args, **kwargs):
    """Run ``fn`` and return ``(result, None)`` or ``(None, exception)``.

    Only exceptions that describe bad input are captured; anything else (a bug,
    ``KeyboardInterrupt``) propagates at once.
    """
    try:
        return fn(*args, **kwargs), None
    except (ValueError, TypeError, IndexError, OverflowError, NotImplementedError, KeyError,
            HpccommError) as exc:
        return None, exc
