"""Helpers shared by the summable quantizers (:mod:`.terngrad`, :mod:`.qsgd`)."""
import numpy as np


def summed_code_dtype(limit: int) -> np.dtype:
    """The narrowest signed integer dtype holding sums in ``[-limit, limit]``
    (int8, int16 or int32; int64 beyond)."""
    for dt in (np.int8, np.int16, np.int32):
        if limit <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def scale_array(scale, count: int, name: str) -> np.ndarray:
    """``scale`` as a contiguous float32 array of ``count`` entries."""
    scales = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
    if scales.size != count:
        raise ValueError(f"{name}: expected {count} shared scale(s), got {scales.size}")
    return scales


def check_total(total, out, name: str) -> None:
    """Validate the arguments of ``from_summable``: integer codes (or sums of
    them) and a float32 target of the same length."""
    if not isinstance(total, np.ndarray) or total.ndim != 1 \
            or not np.issubdtype(total.dtype, np.integer):
        raise TypeError(f"{name}: summed codes must be a 1-D integer array")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1 \
            or not out.flags.c_contiguous:
        raise TypeError(f"{name}: target must be a contiguous 1-D float32 array")
    if total.size != out.size:
        raise ValueError(f"{name}: {total.size} summed codes for {out.size} elements")


def check_no_feedback(codec, ctx) -> None:
    """ValueError for ``to_summable`` under error feedback: codes summed
    across ranks against one shared scale have no per-rank contraction (see
    the codec's docstring), and the unbiased codes make the residual grow."""
    if ctx.feedback:
        raise ValueError(f"{codec.name}: the summable form cannot carry error feedback (the "
                         f"codec is unbiased; use algorithm 'twoshot' or 'allgather', whose "
                         f"packets contract, or error_feedback=False)")
