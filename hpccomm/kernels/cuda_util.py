"""Host-side helpers shared by the ``numba.cuda`` kernel modules
(:mod:`hpccomm.kernels.cuda_quantize`, :mod:`hpccomm.kernels.cuda_sparsify`)."""
import numpy as np
from numba import cuda


def to_device(a, dtype=None):
    """A device array: numpy input is copied (as contiguous ``dtype``), device
    arrays pass through."""
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))
    return a


def launch(threads, kernel, count, *args):
    """Run ``kernel`` on ``count`` items, one thread each, in blocks of
    ``threads``; nothing when ``count`` is 0."""
    if count > 0:
        kernel[(count + threads - 1) // threads, threads](*args)
