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
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np

#: dtype names hpccomm knows.  ``bfloat16`` has no numpy dtype of its own: it
#: is carried as ``uint16`` bit patterns.
KNOWN_DTYPES = ("float32", "float64", "float16", "bfloat16")


# ---------------------------------------------------------------------------
# bfloat16 <-> float32 on the host
# ---------------------------------------------------------------------------
def bf16_bits_to_f32(bits: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 (exact)."""
    wide = bits.astype(np.uint32) << np.uint32(16)
    if out is None:
        return wide.view(np.float32)
    out[...] = wide.view(np.float32)
    return out


def f32_to_bf16_bits(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns, nearest-even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)
    if out is None:
        return rounded
    out[...] = rounded
    return out


# ---------------------------------------------------------------------------
# Device backends
# ---------------------------------------------------------------------------
class DeviceBackend:
    """Operations hpccomm needs on device arrays.  Subclass and
    :func:`register_device_backend` to support another array type."""

    name = "device"

    def matches(self, obj: Any) -> bool:
        raise NotImplementedError

    def synchronize(self, obj: Any) -> None:
        """Wait until the stream that produced ``obj`` is done."""
        raise NotImplementedError

    def to_host(self, obj: Any, out: np.ndarray) -> None:
        """Copy the flat contents of ``obj`` into host array ``out``."""
        raise NotImplementedError

    def from_host(self, host: np.ndarray, obj: Any) -> None:
        """Copy host array ``host`` into the flat contents of ``obj``."""
        raise NotImplementedError

    def empty_like(self, obj: Any) -> Any:
        """A new device array of the same shape and dtype."""
        raise NotImplementedError

    def copy(self, src: Any, dst: Any) -> None:
        """Device-to-device copy of the flat contents of ``src`` into ``dst``."""
        raise NotImplementedError

    def divide(self, obj: Any, divisor: int) -> None:
        """``obj /= divisor`` elementwise, in place (IEEE division, as on the host)."""
        raise NotImplementedError

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """Host staging memory (page-locked where the backend can)."""
        return np.empty(nbytes, dtype=np.uint8)


def _cai_stream_sync(cai: dict) -> bool:
    """Synchronize the stream named in a v3 ``__cuda_array_interface__``."""
    stream = cai.get("stream")
    if stream in (None, 0):
        return False
    try:
        import cupy

        cupy.cuda.ExternalStream(stream).synchronize()
        return True
    except Exception:  # pragma: no cover - needs a GPU
        from numba import cuda

        cuda.external_stream(stream).synchronize()
        return True


class CupyBackend(DeviceBackend):
    """Device arrays through CuPy (accepts any ``__cuda_array_interface__``)."""

    name = "cupy"

    def __init__(self):
        import cupy  # noqa: F401  (ImportError means: not available)

        self._cupy = cupy

    def matches(self, obj):  # pragma: no cover - needs a GPU
        return isinstance(obj, self._cupy.ndarray) or hasattr(obj, "__cuda_array_interface__")

    def _as(self, obj):  # pragma: no cover - needs a GPU
        return self._cupy.asarray(obj).reshape(-1)

    def synchronize(self, obj):  # pragma: no cover - needs a GPU
        cai = getattr(obj, "__cuda_array_interface__", None)
        if not (cai and _cai_stream_sync(cai)):
            self._cupy.cuda.get_current_stream().synchronize()

    def to_host(self, obj, out):  # pragma: no cover - needs a GPU
        self._as(obj).get(out=out)

    def from_host(self, host, obj):  # pragma: no cover - needs a GPU
        self._as(obj).set(host)

    def empty_like(self, obj):  # pragma: no cover - needs a GPU
        return self._cupy.empty_like(self._cupy.asarray(obj))

    def copy(self, src, dst):  # pragma: no cover - needs a GPU
        self._as(dst)[...] = self._as(src)

    def divide(self, obj, divisor):  # pragma: no cover - needs a GPU
        arr = self._as(obj)
        arr /= arr.dtype.type(divisor)

    def pinned_empty(self, nbytes):  # pragma: no cover - needs a GPU
        mem = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


class NumbaCudaBackend(DeviceBackend):  # pragma: no cover - needs a GPU
    """Device arrays through numba.cuda, for machines without CuPy."""

    name = "numba.cuda"

    def __init__(self):
        from numba import cuda

        if not cuda.is_available() or not hasattr(cuda, "as_cuda_array"):
            raise ImportError("numba.cuda has no usable device")
        self._cuda = cuda

    def matches(self, obj):
        return hasattr(obj, "__cuda_array_interface__")

    def _as(self, obj):
        return self._cuda.as_cuda_array(obj).reshape(-1)

    def synchronize(self, obj):
        if not _cai_stream_sync(obj.__cuda_array_interface__):
            self._cuda.synchronize()

    def to_host(self, obj, out):
        self._as(obj).copy_to_host(out)

    def from_host(self, host, obj):
        self._as(obj).copy_to_device(host)

    def empty_like(self, obj):
        arr = self._cuda.as_cuda_array(obj)
        return self._cuda.device_array(arr.shape, dtype=arr.dtype)

    def copy(self, src, dst):
        self._as(dst).copy_to_device(self._as(src))

    def divide(self, obj, divisor):
        # no elementwise kernel here: round-trip through the host (slow path)
        host = self._as(obj).copy_to_host()
        host /= host.dtype.type(divisor)
        self._as(obj).copy_to_device(host)

    def pinned_empty(self, nbytes):
        return self._cuda.pinned_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]


_BACKENDS: List[DeviceBackend] = []
_DEFAULTS_LOADED = False


def register_device_backend(backend: DeviceBackend, first: bool = True) -> None:
    """Add a device backend; ``first=True`` gives it priority."""
    if first:
        _BACKENDS.insert(0, backend)
    else:
        _BACKENDS.append(backend)


def unregister_device_backend(backend: DeviceBackend) -> None:
    if backend in _BACKENDS:
        _BACKENDS.remove(backend)


def _load_default_backends() -> None:
    global _DEFAULTS_LOADED
    if _DEFAULTS_LOADED:
        return
    _DEFAULTS_LOADED = True
    for cls in (CupyBackend, NumbaCudaBackend):
        try:
            _BACKENDS.append(cls())
        except Exception:
            pass


def device_backend_for(obj: Any) -> DeviceBackend:
    _load_default_backends()
    for backend in _BACKENDS:
        if backend.matches(obj):
            return backend
    raise TypeError(
        f"{type(obj).__name__} lives in device memory but no device backend handles it: "
        "install CuPy (pip install 'hpccomm[gpu]') or register a DeviceBackend"
    )


# ---------------------------------------------------------------------------
# CUDA-aware MPI detection
# ---------------------------------------------------------------------------
def _libmpi_handles():
    handles = [ctypes.CDLL(None)]
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
        for path in sorted(paths):
            try:
                handles.append(ctypes.CDLL(path))
            except OSError:
                pass
    except OSError:
        pass
    return handles


def mpi_cuda_support() -> bool:
    """Whether the MPI library reports CUDA support at run time.

    Open MPI: ``MPIX_Query_cuda_support()``; MPICH:
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.  The environment
    variable ``HPCCOMM_GPU_AWARE=0|1`` overrides the answer.
    """
    env = os.environ.get("HPCCOMM_GPU_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "yes", "on", "true")
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    for handle in _libmpi_handles():
        fn = getattr(handle, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return bool(fn())
        fn = getattr(handle, "MPIX_GPU_query_support", None)
        if fn is not None:
            flag = ctypes.c_int(0)
            if fn(ctypes.c_int(1), ctypes.byref(flag)) == 0:  # 1 == MPIX_GPU_SUPPORT_CUDA
                return bool(flag.value)
    return False


def resolve_gpu_aware(gpu_aware) -> bool:
    if gpu_aware in (True, "on"):
        return True
    if gpu_aware in (False, "off"):
        return False
    if gpu_aware == "auto":
        return mpi_cuda_support()
    raise ValueError(f"gpu_aware must be 'auto', 'on' or 'off', not {gpu_aware!r}")


# ---------------------------------------------------------------------------
# Buffer
# ---------------------------------------------------------------------------
@dataclass
class Buffer:
    """A user's array seen as one flat, C-contiguous vector."""

    obj: Any                       #: what the user passed
    kind: str                      #: "numpy", "torch", "cupy", "cuda", "dlpack"
    shape: tuple
    dtype: str                     #: one of KNOWN_DTYPES
    size: int
    host: Optional[np.ndarray]     #: flat numpy view (host memory), bfloat16 as uint16
    device: Any = None             #: flat device object (device memory)
    backend: Optional[DeviceBackend] = None
    wrap: Optional[Callable[[Any], Any]] = None  #: flat result -> user's kind and shape

    @property
    def on_device(self) -> bool:
        return self.host is None


_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
                np.dtype(np.float16): "float16"}


def _np_dtype_name(dt: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is not None:
        return name
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return "bfloat16"
    raise TypeError(f"unsupported dtype {dt}; hpccomm reduces float32 (and float16, bfloat16, "
                    f"float64 where the codec supports them)")


def _numpy_buffer(arr: np.ndarray, obj, kind, wrap) -> Buffer:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{kind} buffer of shape {arr.shape} is not C-contiguous; pass a "
                         "contiguous copy (numpy.ascontiguousarray / tensor.contiguous())")
    name = _np_dtype_name(arr.dtype)
    flat = arr.reshape(-1)
    if name == "bfloat16":  # ml_dtypes.bfloat16: carried as uint16 bit patterns
        flat = flat.view(np.uint16)
        inner, user_dtype = wrap, arr.dtype

        def wrap(res):
            return inner(res.view(user_dtype))
    return Buffer(obj=obj, kind=kind, shape=tuple(arr.shape), dtype=name, size=flat.size,
                  host=flat, wrap=wrap)


def _torch_buffer(t) -> Buffer:
    import torch

    if t.is_cuda:
        if not t.is_contiguous():
            raise ValueError(f"torch tensor of shape {tuple(t.shape)} is not contiguous; "
                             "call .contiguous() first")
        name = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}.get(t.dtype)
        if name is None:
            raise TypeError(f"unsupported dtype {t.dtype}")
        shape = tuple(t.shape)
        flat = t.detach().reshape(-1)
        backend = device_backend_for(flat)

        def wrap_cuda(res):
            return torch.as_tensor(res, device=t.device).reshape(shape)

        return Buffer(obj=t, kind="torch", shape=shape, dtype=name, size=flat.numel(), host=None,
                      device=flat, backend=backend, wrap=wrap_cuda)
    if t.device.type != "cpu":
        raise TypeError(f"torch tensors on device {t.device} are not supported")
    if not t.is_contiguous():
        raise ValueError(f"torch tensor of shape {tuple(t.shape)} is not contiguous; "
                         "call .contiguous() first")
    shape = tuple(t.shape)
    if t.dtype == torch.bfloat16:
        flat = t.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)

        def wrap_bf16(res):
            return torch.from_numpy(np.ascontiguousarray(res).view(np.int16)).view(torch.bfloat16).reshape(shape)

        return Buffer(obj=t, kind="torch", shape=shape, dtype="bfloat16", size=flat.size,
                      host=flat, wrap=wrap_bf16)
    try:
        arr = t.detach().numpy()
    except TypeError as exc:
        raise TypeError(f"unsupported dtype {t.dtype}") from exc

    def wrap_torch(res):
        return torch.from_numpy(res).reshape(shape)

    return _numpy_buffer(arr, t, "torch", wrap_torch)


def _cai_buffer(obj, kind) -> Buffer:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dt = np.dtype(cai["typestr"])
    name = _np_dtype_name(dt)
    strides = cai.get("strides")
    if strides is not None:
        expected, acc = [], dt.itemsize
        for dim in reversed(shape):
            expected.append(acc)
            acc *= dim
        if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
            raise ValueError(f"device buffer of shape {shape} is not C-contiguous")
    backend = device_backend_for(obj)
    size = int(np.prod(shape)) if shape else 1

    def wrap_dev(res):
        if kind == "cupy":
            return res.reshape(shape)
        return res

    return Buffer(obj=obj, kind=kind, shape=shape, dtype=name, size=size, host=None, device=obj,
                  backend=backend, wrap=wrap_dev)


def as_buffer(x: Any) -> Buffer:
    """Describe ``x`` as a :class:`Buffer`.  Raises ``TypeError`` for objects
    or dtypes hpccomm cannot reduce and ``ValueError`` for non-contiguous ones."""
    if isinstance(x, np.ndarray):
        shape = x.shape
        return _numpy_buffer(x, x, "numpy", lambda res: res.reshape(shape))
    module = type(x).__module__ or ""
    if module.startswith("torch") and hasattr(x, "is_cuda"):
        return _torch_buffer(x)
    if module.startswith("cupy"):
        return _cai_buffer(x, "cupy")
    if hasattr(x, "__cuda_array_interface__"):
        return _cai_buffer(x, "cuda")
    if hasattr(x, "__dlpack__"):
        try:
            arr = np.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError) as exc:
            raise TypeError(f"cannot read {type(x).__name__} through DLPack: {exc}") from exc
        shape = arr.shape
        return _numpy_buffer(arr, x, "dlpack", lambda res: res.reshape(shape))
    raise TypeError(f"cannot reduce a {type(x).__name__}: pass a numpy array, a torch tensor, "
                    "a CuPy array or an object with __cuda_array_interface__")


class HostStaging:
    """Reused host buffers for staging device data (pinned when possible)."""

    def __init__(self):
        self._buffers = {}

    def get(self, slot: str, nbytes: int, backend: Optional[DeviceBackend]) -> np.ndarray:
        buf = self._buffers.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = backend.pinned_empty(nbytes) if backend is not None else np.empty(nbytes, np.uint8)
            self._buffers[slot] = buf
        return buf[:nbytes]
