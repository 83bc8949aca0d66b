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
    Device buffers are handled by a :class:`DeviceBackend` (torch for torch
    tensors, CuPy when it works, numba.cuda otherwise).  Each call asks it once,
    on the caller's thread, for the buffer's :class:`Placement` -- its GPU and
    the stream that produced it (torch's or CuPy's current stream, else the
    stream named in ``__cuda_array_interface__`` version 3) -- and everything
    the call does with device memory runs on that GPU, ordered on that
    stream.  With ``gpu_aware`` on, device pointers go straight to MPI (after
    the stream is synchronized); otherwise data is staged through reused host
    buffers (pinned where the backend can).
"""
from .adapters import Buffer, as_buffer, placement_of
from .device import (CupyBackend, DeviceBackend, NumbaCudaBackend, Placement, TorchBackend,
                     device_backend_for, register_device_backend, unregister_device_backend)
from .dtypes import KNOWN_DTYPES, bf16_bits_to_f32, dtype_name, f32_to_bf16_bits
from .gpu_aware import mpi_cuda_support, mpi_cuda_support_reason, resolve_gpu_aware
from .staging import HostStaging

__all__ = ["Buffer", "as_buffer", "placement_of", "Placement", "CupyBackend", "DeviceBackend",
           "NumbaCudaBackend", "TorchBackend",
           "device_backend_for", "register_device_backend", "unregister_device_backend",
           "KNOWN_DTYPES", "bf16_bits_to_f32", "dtype_name", "f32_to_bf16_bits",
           "mpi_cuda_support", "mpi_cuda_support_reason", "resolve_gpu_aware", "HostStaging"]
