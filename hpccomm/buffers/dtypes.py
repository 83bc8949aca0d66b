"""dtype names hpccomm knows, and bfloat16 <-> float32 on the host.

``bfloat16`` has no numpy dtype of its own: it is carried as ``uint16`` bit
patterns.  The conversions are the ``bf16`` codec's kernels
(:mod:`hpccomm.kernels.halfwidth`), so there is one rounding of bfloat16 in
hpccomm: nearest even, NaN stays a (quiet) NaN.  The one difference is
deliberate: a user's bfloat16 result rounds float32 values beyond the
bfloat16 range to infinity, as IEEE rounding does, while the codec saturates
finite values to the largest bfloat16 (its error feedback keeps the excess).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..kernels import halfwidth as K

#: dtype names hpccomm knows
KNOWN_DTYPES = ("float32", "float64", "float16", "bfloat16")


DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
                np.dtype(np.float16): "float16"}


def dtype_name(dt: np.dtype) -> str:
    name = DTYPE_NAMES.get(dt)
    if name is not None:
        return name
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return "bfloat16"
    raise TypeError(f"unsupported dtype {dt}; hpccomm reduces float32 (and float16, bfloat16, "
                    f"float64 where the codec supports them)")


def bf16_bits_to_f32(bits: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 (exact)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    res = np.empty(bits.shape, dtype=np.float32)
    K.bf16_to_f32(bits.reshape(-1), res.reshape(-1), False)
    if out is None:
        return res
    out[...] = res.reshape(out.shape)
    return out


def f32_to_bf16_bits(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns, nearest even; beyond the range
    to infinity; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32)
    res = np.empty(u.shape, dtype=np.uint16)
    K.f32_to_bf16(u.reshape(-1).view(np.uint32), res.reshape(-1), False)
    if out is None:
        return res
    out[...] = res
    return out
