"""Host memory presented as device memory: :class:`HostDeviceArray` (a numpy
array behind a ``__cuda_array_interface__``, the way mpi4py's own tests reach
its GPU paths without a GPU) and :class:`HostDeviceBackend`, which serves it.

Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), whose kernels
read and write host memory, a backend made with ``device_kernels=True`` runs
the whole device path on these arrays -- twins, pipeline, staging -- with no
GPU: ``bench allreduce --buffer sim`` and the test suite do.  Without it
(the default) they are device memory no hpccomm kernel addresses, and the
reducer stages them whole through the host.

The backend counts what it is asked to copy (``to_host_calls``,
``from_host_calls``) and keeps the staging buffers it made (``pinned``), so
that a caller can tell what crossed to the host.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .device import DeviceBackend, Placement, cai_stream


class HostDeviceArray:
    """A numpy array exposed through ``__cuda_array_interface__`` (version
    3), naming ``stream`` as its producer (None: no stream)."""

    def __init__(self, host: np.ndarray, stream: Optional[int] = None):
        self.host = host
        self.stream = stream
        #: times a backend waited for the stream that produced it
        self.synced = 0

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.host.shape, "typestr": self.host.dtype.str,
                "data": (self.host.ctypes.data, False), "version": 3, "strides": None,
                "stream": self.stream}


class HostDeviceBackend(DeviceBackend):
    """Device operations for :class:`HostDeviceArray` (plain host copies; see
    the module docstring).  Its one "GPU" is ordinal 0."""

    name = "host-device"

    def __init__(self, device_kernels: bool = False):
        self.device_kernels = bool(device_kernels)
        self.to_host_calls = 0
        self.from_host_calls = 0
        self.pinned = []

    def matches(self, obj):
        return isinstance(obj, HostDeviceArray)

    def placement(self, obj):
        return Placement(0, cai_stream(obj))

    def synchronize(self, obj, where):
        obj.synced += 1

    def to_host(self, obj, out, where):
        self.synchronize(obj, where)        # ordered after the producing stream
        self.to_host_calls += 1
        out.view(np.uint8)[...] = obj.host.reshape(-1).view(np.uint8)

    def from_host(self, host, obj, where):
        self.from_host_calls += 1
        obj.host.reshape(-1).view(np.uint8)[...] = host.view(np.uint8)

    def empty_like(self, obj, where):
        return HostDeviceArray(np.empty_like(obj.host), obj.stream)

    def copy(self, src, dst, where):
        dst.host[...] = src.host

    def divide(self, obj, divisor, where):
        obj.host /= obj.host.dtype.type(divisor)

    def pinned_empty(self, nbytes):
        buf = np.empty(nbytes, dtype=np.uint8)
        self.pinned.append(buf)
        return buf
