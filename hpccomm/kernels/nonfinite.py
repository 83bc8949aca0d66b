"""Small kernels shared by the codecs and the reducer."""
import numpy as np
from numba import njit

#: all exponent bits of each IEEE float width, as the unsigned type of that width
_EXPONENT = {np.dtype(np.float16): np.uint16(0x7C00), np.dtype(np.float32): np.uint32(0x7F800000),
             np.dtype(np.float64): np.uint64(0x7FF0000000000000)}
_BITS = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32,
         np.dtype(np.float64): np.uint64}


@njit(cache=True, nogil=True)
def _count_all_ones(u, mask):
    """How many ``u[i]`` have every bit of ``mask`` set."""
    c = 0
    for i in range(u.size):
        c += (u[i] & mask) == mask
    return c


@njit(cache=True, nogil=True)
def _count_nonfinite_f32(x):
    """:func:`count_nonfinite` of a 1-D float32 array."""
    u = x.view(np.uint32)
    c = 0
    for i in range(u.size):
        c += (u[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return c


_F32 = np.dtype(np.float32)


def count_nonfinite(x: np.ndarray, bfloat16: bool = False) -> int:
    """Number of NaN / Inf entries of a contiguous float16/32/64 array (or of
    bfloat16 bit patterns in a uint16 array, ``bfloat16=True``): one pass over
    the bit patterns (all exponent bits set), without the temporary boolean
    array of ``np.isfinite``.  A 1-D float32 array (every repeated call's
    scan) goes straight to its kernel: 0.3 us for 1024 elements, against
    0.8 us through the dtype tables."""
    if x.ndim == 1 and x.dtype == _F32 and not bfloat16:
        return int(_count_nonfinite_f32(x))
    flat = x.reshape(-1)
    if bfloat16:
        return int(_count_all_ones(flat.view(np.uint16), np.uint16(0x7F80)))
    mask = _EXPONENT.get(x.dtype)
    if mask is None:
        return int(np.count_nonzero(~np.isfinite(flat)))
    return int(_count_all_ones(flat.view(_BITS[x.dtype]), mask))
