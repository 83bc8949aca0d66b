"""User buffers: numpy arrays, torch tensors, CuPy arrays and CUDA array objects.

:func:`as_buffer` turns what the user passed into a :class:`Buffer`: a flat,
C-contiguous 1-D view of the same memory (no copy), the original shape and
dtype, where the memory lives, and how to hand a result back as the same kind
of object.

Accepted
    * ``numpy.ndarray`` (any shape; flattened as C order);
    * ``torch.Tensor`` on the CPU (zero-copy numpy view) or on CUDA (through
      ``__cuda_array_interface__`` / DLPack);
    * ``cupy.ndarray`` and any object exposing ``__cuda_array_interface__``;
    * any other object exposing ``__dlpack__`` on the CPU.

dtypes
    float32 everywhere; float64, float16 and bfloat16 where the codec declares
    them (see ``Codec.input_dtypes``).  Half-precision inputs are widened to
    float32 for the reduction and rounded back at the end.  Anything else is a
    ``TypeError``.

Contiguity
    Non-contiguous input is a ``ValueError``: hpccomm never copies behind the
    user's back.  Call ``numpy.ascontiguousarray`` (or ``.contiguous()``) first.

Device memory
    Device buffers are handled by a :class:`DeviceBackend` (CuPy when it works,
    numba.cuda otherwise).  With ``gpu_aware`` on, device pointers go straight
    to MPI; otherwise data is staged through reused host buffers (pinned when
    CuPy is present).  Before MPI or a host copy reads device memory, the
    producing stream is synchronized: the stream named in
    ``__cuda_array_interface__`` (version 3), else the current CuPy stream.
"""
from .adapters import Buffer, as_buffer
from .device import (CupyBackend, DeviceBackend, NumbaCudaBackend, device_backend_for,
                     register_device_backend, unregister_device_backend)
from .dtypes import KNOWN_DTYPES, bf16_bits_to_f32, dtype_name, f32_to_bf16_bits
from .gpu_aware import mpi_cuda_support, resolve_gpu_aware
from .staging import HostStaging

__all__ = ["Buffer", "as_buffer", "CupyBackend", "DeviceBackend", "NumbaCudaBackend",
           "device_backend_for", "register_device_backend", "unregister_device_backend",
           "KNOWN_DTYPES", "bf16_bits_to_f32", "dtype_name", "f32_to_bf16_bits",
           "mpi_cuda_support", "resolve_gpu_aware", "HostStaging"]
