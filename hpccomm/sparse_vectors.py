"""Sparse vectors and the sparse allreduce entry point.

>>> sv = hpccomm.SparseVector([7, 2, 7], [1.0, 2.0, 0.5], n=10)   # sorted, duplicates summed
>>> sv.indices, sv.values
(array([2, 7], dtype=int32), array([2. , 1.5], dtype=float32))
>>> total = hpccomm.sparse_allreduce(sv, algorithm="sparse_split")            # dense float32
>>> total_sv = hpccomm.sparse_allreduce(sv, algorithm="sparse_rd", result="sparse")

Every rank passes its own sparse vector of the same length ``n``; the result
(the sum over ranks) is identical, bit for bit, on every rank.  The algorithms
are the sparse ones among :func:`~hpccomm.available_algorithms`
(:func:`sparse_algorithms`); each has its module under
:mod:`hpccomm.collectives`, which describes its wire protocol and cost, and
each also serves :class:`~hpccomm.Allreducer` for dense input
(``Allreducer(codec="topk", algorithm="sparse_rd")``: the codec picks each
rank's non-zeros, error feedback keeps the rest).

Validation is collective: :func:`sparse_allreduce` checks its input on every
rank (indices inside ``[0, n)``, equal lengths, finite values, known algorithm
and options) and agrees on the outcome with one small ``MPI_Allreduce``, so
bad input on any rank raises the same error, naming that rank, on every rank
-- never a hang.  Build the :class:`SparseVector` inside the call (pass the
triple ``(indices, values, n)``) when construction itself may fail: a
:class:`SparseVector` constructor raises on its own rank only.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
from mpi4py import MPI

from .codecs import get_codec
from .collectives.base import ALGORITHMS
from .collectives.sparse import SparseAlgorithm, index_dtype
from .communicators import private_comm
from .collectives.transport import Transport
from .errors import NonFiniteError
from .state import KeyState
from .kernels import merge as K
from .options import resolve_options
from .stats import CallStats
from .failstop import check_on_error, stranded
from .validation import agree, check_local

RESULTS = ("dense", "sparse")
_MAX_N = 2 ** 63 - 1


def sparse_algorithms() -> Tuple[str, ...]:
    """Names of the registered algorithms that take sparse input."""
    return tuple(name for name, cls in ALGORITHMS.items() if issubclass(cls, SparseAlgorithm))


class SparseVector:
    """A sparse float32 vector of length ``n``: sorted indices and their values.

    ``indices`` become strictly increasing int32 (int64 when ``n >= 2**31``)
    and ``values`` float32.  Unsorted input is sorted; **duplicate indices are
    merged by summing their values**, in the order given (a stable sort, then a
    left-to-right sum).  Explicit zero values are kept.

    Raises (on this rank) ``TypeError`` for non-integer indices or non-real
    values, ``ValueError`` for mismatched lengths, a negative ``n``, or an index
    that is negative or ``>= n``, and :class:`~hpccomm.errors.NonFiniteError`
    for NaN/Inf values under ``nonfinite="raise"`` (the default;
    ``"propagate"`` lets them through).
    """

    __slots__ = ("indices", "values", "n", "nonfinite")

    def __init__(self, indices, values, n: int, *, nonfinite: str = "raise"):
        n = _check_length(n)
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', not {nonfinite!r}")
        idx = np.asarray(indices)
        vals = np.asarray(values)
        if idx.ndim != 1 or vals.ndim != 1:
            raise ValueError(f"SparseVector: indices and values must be 1-D, got shapes "
                             f"{idx.shape} and {vals.shape}")
        if idx.size != vals.size:
            raise ValueError(f"SparseVector: {idx.size} indices but {vals.size} values")
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"SparseVector: indices must be integers, not {idx.dtype}")
        if vals.size == 0:
            vals = vals.astype(np.float32)
        if vals.dtype.kind not in "fiu":
            raise TypeError(f"SparseVector: values must be real numbers, not {vals.dtype}")
        _check_range(idx, n)
        idx64 = idx.astype(np.int64)
        with np.errstate(over="ignore"):  # out-of-range values become Inf: checked below
            vals32 = np.ascontiguousarray(vals, dtype=np.float32)
        if idx64.size > 1 and not np.all(idx64[1:] > idx64[:-1]):
            order = np.argsort(idx64, kind="stable")
            idx64, vals32 = K.coalesce_sorted(idx64[order], vals32[order])
        self.indices = idx64.astype(index_dtype(n))
        self.values = vals32 if vals32 is not vals else vals32.copy()
        self.n = n
        self.nonfinite = nonfinite
        self._check_finite()

    @classmethod
    def from_dense(cls, x, **kwargs) -> "SparseVector":
        """The non-zero entries of a 1-D array."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        nz = np.flatnonzero(x)
        return cls(nz, x[nz], x.size, **kwargs)

    @classmethod
    def _trusted(cls, indices, values, n, nonfinite="propagate") -> "SparseVector":
        """Wrap arrays already sorted, unique, in range and typed (no checks)."""
        sv = cls.__new__(cls)
        sv.indices, sv.values, sv.n, sv.nonfinite = indices, values, int(n), nonfinite
        return sv

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def to_dense(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The dense float32 vector (written into ``out`` when given)."""
        if out is None:
            out = np.zeros(self.n, dtype=np.float32)
        else:
            if out.shape != (self.n,) or out.dtype != np.float32:
                raise ValueError(f"out must be float32 of shape ({self.n},)")
            out[...] = 0
        out[self.indices] = self.values
        return out

    def validate(self) -> None:
        """Re-check the invariants (the arrays are mutable; the collectives
        call this before any kernel, which does no bounds checks)."""
        idx, vals = self.indices, self.values
        if not isinstance(idx, np.ndarray) or not isinstance(vals, np.ndarray) \
                or idx.ndim != 1 or vals.ndim != 1 or idx.size != vals.size:
            raise ValueError("SparseVector: indices and values must be 1-D arrays of equal length")
        if idx.dtype != index_dtype(self.n) or vals.dtype != np.float32:
            raise TypeError(f"SparseVector: expected {index_dtype(self.n)} indices and float32 "
                            f"values, found {idx.dtype} and {vals.dtype}")
        _check_range(idx, self.n)
        if idx.size > 1 and not np.all(idx[1:] > idx[:-1]):
            raise ValueError("SparseVector: indices are not strictly increasing")
        self._check_finite()

    def _check_finite(self) -> None:
        if self.nonfinite == "raise" and self.values.size and not np.isfinite(self.values).all():
            bad = int(np.count_nonzero(~np.isfinite(self.values)))
            raise NonFiniteError(f"SparseVector: values hold {bad} NaN/Inf value(s) "
                                 "(policy nonfinite='raise')")

    def __repr__(self) -> str:
        return f"SparseVector(n={self.n}, nnz={self.nnz}, index dtype={self.indices.dtype})"


def _check_length(n) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"SparseVector: n must be an integer, not {type(n).__name__}")
    n = int(n)
    if n < 0 or n > _MAX_N:
        raise ValueError(f"SparseVector: n must be in [0, 2**63), got {n}")
    return n


def _check_range(idx: np.ndarray, n: int) -> None:
    if idx.size == 0:
        return
    if int(idx.min()) < 0:
        pos = int(np.argmax(idx < 0))
        raise ValueError(f"SparseVector: index {int(idx[pos])} at position {pos} is negative")
    if int(idx.max()) >= n:  # then n fits idx's dtype
        pos = int(np.argmax(idx >= n))
        raise ValueError(f"SparseVector: index {int(idx[pos])} at position {pos} is out of "
                         f"range for n={n}")


def sparse_allreduce(sv: Union[SparseVector, tuple], comm: Optional[MPI.Comm] = None, *,
                     algorithm: str = "sparse_split", result: str = "dense",
                     out: Optional[np.ndarray] = None, state: Optional[KeyState] = None,
                     stats: Optional[CallStats] = None, on_error: str = "abort",
                     **options) -> Union[np.ndarray, SparseVector]:
    """Sum sparse vectors over the ranks of ``comm`` (collective).

    Parameters
    ----------
    sv:
        This rank's :class:`SparseVector`, or a triple ``(indices, values, n)``
        that is turned into one inside the collective validation (so that a
        construction error on one rank is raised on every rank).
    comm:
        The communicator (default ``MPI.COMM_WORLD``); hpccomm works on a
        private duplicate of it.
    algorithm:
        One of :func:`sparse_algorithms`: ``sparse_allgather``, ``sparse_rd``,
        ``sparse_split`` (default), ``oktopk``, ``kylix``, ``sparse_op``,
        ``rle_pipeline``.
    result:
        ``"dense"``: a float32 array of length ``n``.  ``"sparse"``: a
        :class:`SparseVector` of the sum's entries whose value is not 0.0.
    out:
        For a dense result: a contiguous float32 array of length ``n`` to
        write it into (and return), instead of a new one.
    state:
        A :class:`~hpccomm.state.KeyState` to keep algorithm caches between
        calls (``kylix`` reuses its routing configuration while every rank's
        index set repeats).  Pass the same object on every call of one tensor.
    stats:
        A :class:`~hpccomm.stats.CallStats` to add this call's figures to
        (bytes, time split, ``extra`` such as ``went_dense``).
    on_error:
        An exception raised on some ranks inside the call: ``"abort"`` ends
        the job (``MPI_Abort``), ``"raise"`` raises it on those ranks only
        (see :mod:`hpccomm.failstop`).
    **options:
        Algorithm options (e.g. ``degrees=(4, 2)`` for ``kylix``).

    Returns the same result, bit for bit, on every rank.
    """
    parent = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(parent, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py Intracomm, not {type(comm).__name__}")
    prepared, err = check_local(_prepare, parent, sv, algorithm, result, out, state, stats,
                                on_error, options)
    desc = "<error>"
    if err is None:
        vec, alg = prepared
        desc = f"n={vec.n} algorithm={alg.describe()} result={result}"
    agree(parent, desc, err)
    call = stats if stats is not None else CallStats()
    net = Transport(private_comm(parent), call)
    call.n = vec.n
    call.nbytes = 4 * vec.n
    state = state if state is not None else KeyState()
    try:
        if result == "dense":
            if out is None:
                out = np.empty(vec.n, dtype=np.float32)
            alg.reduce_sparse(vec.indices, vec.values, vec.n, state, net, out)
            return out
        idx, vals = alg.reduce_sparse(vec.indices, vec.values, vec.n, state, net, None)
    except Exception as exc:
        stranded(exc, net.comm, on_error, lambda: f"sparse_allreduce of {vec.n} elements, {desc}")
        raise
    return SparseVector._trusted(idx.astype(index_dtype(vec.n), copy=False), vals, vec.n)


def _prepare(parent, sv, algorithm, result, out, state, stats, on_error, options):
    if isinstance(sv, SparseVector):
        sv.validate()
        vec = sv
    elif isinstance(sv, tuple) and len(sv) == 3:
        vec = SparseVector(*sv)
    else:
        raise TypeError(f"sparse_allreduce takes a SparseVector or an (indices, values, n) "
                        f"tuple, not {type(sv).__name__}")
    if result not in RESULTS:
        raise ValueError(f"result must be one of {RESULTS}, not {result!r}")
    check_on_error(on_error)
    if out is not None:
        if result != "dense":
            raise ValueError("out is only for result='dense'")
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (vec.n,) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable contiguous float32 array of shape "
                             f"({vec.n},)")
    if state is not None and not isinstance(state, KeyState):
        raise TypeError(f"state must be a hpccomm.state.KeyState, not {type(state).__name__}")
    if stats is not None and not isinstance(stats, CallStats):
        raise TypeError(f"stats must be a hpccomm.CallStats, not {type(stats).__name__}")
    cls = ALGORITHMS.get(algorithm)
    if not issubclass(cls, SparseAlgorithm):
        raise ValueError(f"algorithm {algorithm!r} does not take sparse input; sparse "
                         f"algorithms: {', '.join(sparse_algorithms())}")
    _, alg_options = resolve_options(None, algorithm, options)
    alg = cls(parent, get_codec("none"), **alg_options)
    return vec, alg
