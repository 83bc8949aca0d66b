"""What the slot kernels share (:mod:`.exact_topk`, :mod:`.threshold_slots`,
:mod:`.adaptive_slots`): the status of a refused packet, the count in a
slot's header, the NaN/Inf count, the owner's ``w = acc + e``, and the cut
of the ``k`` largest magnitudes.

A slot is a packet's bytes at its capacity, laid out once for a repeated
small ``twoshot`` call (:class:`hpccomm.collectives.twoshot.TwoShotPlan`):
its header written once but for the count (``extra``, bytes 4-7), which the
kernels write."""
import numpy as np
from numba import njit

from .sparsify import SMALL_K, _insert_desc, _kth_largest_inplace

#: a received packet that a slot kernel refuses (too many entries, indices
#: out of order or range, a bad field): nothing was written
BAD_PACKET = -1


@njit(cache=True, nogil=True, inline="always")
def put_count(slot, c):
    """The header's ``extra`` (little-endian uint32) of ``slot``."""
    slot[4] = np.uint8(c & 0xFF)
    slot[5] = np.uint8((c >> 8) & 0xFF)
    slot[6] = np.uint8((c >> 16) & 0xFF)
    slot[7] = np.uint8((c >> 24) & 0xFF)


@njit(cache=True, nogil=True)
def count_nonfinite(v):
    bad = 0
    for i in range(v.size):
        bad += not np.isfinite(v[i])
    return bad


@njit(cache=True, nogil=True, inline="always")
def owner_sum(out, e, has_e, e_out, has_e_out):
    """The owner's vector to select from, ``(w, NaN/Inf count)``: ``w = out
    + e`` (``out`` without ``has_e``) written to ``e_out`` with
    ``has_e_out``, else ``out`` itself."""
    if not has_e_out:
        return out, count_nonfinite(out)
    for i in range(out.size):
        e_out[i] = out[i] + e[i] if has_e else out[i]
    return e_out, count_nonfinite(e_out)


@njit(cache=True, nogil=True)
def kth_magnitude(v, k, mags):
    """``(t, greater)``: the ``k``-th largest ``|v_i|`` of finite ``v`` (``0 <
    k < v.size``) and how many lie above it -- the ``k`` largest are those
    and the first ``k - greater`` equal to ``t``.  ``mags``: scratch of
    ``v.size``.  Up to :data:`~hpccomm.kernels.sparsify.SMALL_K`, from a
    descending list of the ``k`` largest, which few values enter (under
    error feedback a residual of many close magnitudes made the quickselect
    of 512 take 5 us, the list 1.4); beyond, a quickselect."""
    n = v.size
    if k <= SMALL_K:
        filled = 0
        for i in range(n):
            a = abs(v[i])
            if filled < k or a > mags[k - 1]:
                filled = _insert_desc(mags, filled, k, a)
        t = mags[k - 1]
    else:
        for i in range(n):
            mags[i] = abs(v[i])
        t = _kth_largest_inplace(mags, n, k)
    greater = 0
    for i in range(n):
        greater += abs(v[i]) > t
    return t, greater
