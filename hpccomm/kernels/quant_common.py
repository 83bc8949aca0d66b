"""What the CPU kernels of the quantizing codecs share: lane sums, blocks,
``v = x + e``.

The kernels live in one module per codec family: :mod:`.halfwidth` (fp16,
bf16), :mod:`.onebit`, :mod:`.terngrad`, :mod:`.qsgd`, :mod:`.fp8`, and
:mod:`.bitcodes` for the ``b``-bit codes of TernGrad and QSGD.  Each
produces the same bytes as its counterpart in
:mod:`hpccomm.kernels.cuda_quantize`.

numba ``@njit(cache=True, nogil=True)`` loops over flat, contiguous arrays.  The codecs in
:mod:`hpccomm.codecs` validate every size and header field before calling
them: the kernels do no bounds checks.

Floating-point sums (column means, bucket norms, moments) are float64 partial
sums in :data:`LANES` lanes -- element ``i`` of a range starting at ``lo`` goes
to lane ``(i - lo) mod LANES`` -- combined by the fixed pairwise tree of
:func:`_lane_total`.  The order is fixed, so results depend on the data alone
(not on threads or on the machine), and the lanes let LLVM vectorize.

Performance notes: the kernels run on one thread, except onebit's, which
have a parallel form over tiles of whole columns
(:func:`~hpccomm.kernels.onebit.onebit_encode_tiles`, the same bits on any
thread count); encoders
read the input once where the format allows (TernGrad needs its scale first:
two passes), working block by block through small L1-resident scratch
arrays.  Hot loops index slices with ``range`` variables, or with uint64, so
that numba emits no negative-index wraparound (which defeats vectorization).
Packing through uint16 / uint32 views of the scratch assumes a little-endian
host.

What makes the loops vectorize (LLVM's loop vectorizer; numba runs no
SLP vectorizer, so a loop that LLVM unrolls fully stays scalar):

* the random counter ``key + (i + 1) GOLDEN`` is advanced by one addition per
  element (:func:`~hpccomm.kernels.rng.weyl`), not recomputed with a multiply:
  the hash (two 64-bit multiplies, ``vpmullq``) is still about half of the
  vector instructions of TernGrad's and QSGD's code loops;
* element loops are branch-free (selects, float32 lanes for TernGrad's code,
  QSGD's ``floor(a + u)`` as an integer shift of ``|v| ratio 2**24 + r``)
  and read ``x`` and ``e`` straight from memory while they compute, which
  overlaps memory and arithmetic better than a copy into scratch first;
* lane sums take :data:`ROWS` rows per step of the lane loop, which LLVM
  then vectorizes across lanes instead of unrolling it; counts of
  non-finite values are taken only when a sum comes out non-finite;
* read-only passes prefetch 4 KiB ahead (:mod:`hpccomm.kernels.prefetch`);
  QSGD takes each bucket's scale one bucket ahead of its codes, which read
  the bucket again from cache;
* the unpacking of ``b``-bit codes spreads bytes into words and
  sign-extends all their bytes at once.

Measured on one core of the development machine (Sapphire Rapids, 64 MiB of
float32): encode with error feedback at ~55 % (TernGrad: two passes) and
~60 % (QSGD) of the memory floor of ``bench codecs`` -- against ~18 % for
the three steps before -- and the fused owner steps ~4x faster than decode-add,
compensate, re-encode, decode and subtract.  Only the stores of the residual
are left to the write-allocate path (non-temporal stores did not survive
LLVM's vectorizer).
"""
import numpy as np
from numba import njit

#: float64 partial sums per reduction (see the module docstring)
LANES = 32
#: elements per block of the blocked encoders (a multiple of 32)
BLOCK = 4096
#: rows of :data:`LANES` elements per step of the lane sums: the lane loop
#: then holds ``ROWS`` sequential adds per lane, too large for LLVM to unroll
#: it fully (numba runs no SLP vectorizer, so a fully unrolled loop stays
#: scalar) -- it vectorizes across the lanes instead, in the same order
ROWS = 8
F32_MAX = float(np.finfo(np.float32).max)


@njit(cache=True, nogil=True, inline="always")
def strided_rows(rows):
    """``rows`` (2-D) typed as strided (numba's layout ``A``).  The rows of a
    chunk's received packets are strided (:func:`~hpccomm.codecs.base.payload_rows`),
    except that numpy calls a single row C-contiguous; an owner step hands
    its body ``strided_rows(...)`` so that numba compiles that body once for
    both (each specialisation of a large body costs seconds on a fresh
    cache)."""
    return rows[:, :]


@njit(cache=True, nogil=True, inline="always")
def _lane_total(acc, start):
    """Sum of ``acc[start:start + LANES]`` as a fixed pairwise tree (lane
    ``k`` += lane ``k + w`` for ``w`` = 16, 8, 4, 2, 1); clobbers the lanes."""
    w = LANES // 2
    while w >= 1:
        for k in range(w):
            acc[start + k] += acc[start + k + w]
        w //= 2
    return acc[start]


@njit(cache=True, nogil=True, inline="always")
def _compensate_block(xb, eb, has_e, ob):
    """``ob = xb + eb`` (``xb`` without ``has_e``); returns how many are
    non-finite (``v - v`` is NaN exactly for inf and NaN)."""
    bad = 0
    if has_e:
        for k in range(xb.size):
            v = xb[k] + eb[k]
            ob[k] = v
            bad += (v - v) != 0
    else:
        for k in range(xb.size):
            v = xb[k]
            ob[k] = v
            bad += (v - v) != 0
    return bad


@njit(cache=True, nogil=True, inline="always")
def _v(x, e, i):
    """``v = x[i] + e[i]`` in float32, or ``x[i]`` for ``e=None`` (``i``
    uint64: no wraparound checks).  The optional operands of the kernels
    below are None or arrays, never an optional type, so that numba drops
    the unused branch."""
    if e is None:
        return x[i]
    return x[i] + e[i]


@njit(cache=True, nogil=True, inline="always")
def _row_split(m):
    """How the lane sums walk ``m`` elements: ``(full, body)`` -- groups of
    :data:`ROWS` rows of :data:`LANES` up to ``full``, then whole rows up to
    ``body``, then a partial row."""
    return m - m % (ROWS * LANES), m - m % LANES


@njit(cache=True, nogil=True)
def _count_nonfinite(x, e, lo, hi):
    """How many ``v = x + e`` (``x`` for ``e=None``) over ``[lo, hi)`` are
    non-finite (``v - v`` is NaN exactly for inf and NaN).  Kernels whose
    sums turn non-finite exactly when some ``v`` is call it only then."""
    bad = 0
    for k in range(hi - lo):
        v = _v(x, e, np.uint64(lo + k))
        bad += (v - v) != 0
    return bad
