"""Small kernels shared by the codecs and the reducer."""
import numpy as np
from numba import njit

_EXP32 = np.uint32(0x7F800000)
_EXP16 = np.uint16(0x7C00)
_EXP64 = np.uint64(0x7FF0000000000000)


@njit(cache=True)
def _count_nonfinite32(u):
    c = 0
    for i in range(u.size):
        c += (u[i] & _EXP32) == _EXP32
    return c


@njit(cache=True)
def _count_nonfinite16(u):
    c = 0
    for i in range(u.size):
        c += (u[i] & _EXP16) == _EXP16
    return c


@njit(cache=True)
def _count_nonfinite64(u):
    c = 0
    for i in range(u.size):
        c += (u[i] & _EXP64) == _EXP64
    return c


def count_nonfinite(x: np.ndarray) -> int:
    """Number of NaN / Inf entries of a contiguous float16/32/64 array: one
    vectorized pass over the bit patterns (all exponent bits set), without
    the temporary boolean array of ``np.isfinite``."""
    flat = x.reshape(-1)
    if x.dtype == np.float32:
        return int(_count_nonfinite32(flat.view(np.uint32)))
    if x.dtype == np.float16:
        return int(_count_nonfinite16(flat.view(np.uint16)))
    if x.dtype == np.float64:
        return int(_count_nonfinite64(flat.view(np.uint64)))
    return int(np.count_nonzero(~np.isfinite(flat)))
