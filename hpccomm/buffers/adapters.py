"""The user's array as a :class:`Buffer`: a flat, C-contiguous 1-D view of the
same memory (no copy), its shape and dtype, where it lives, and how to hand a
result back as the same kind of object (see :mod:`hpccomm.buffers`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .device import DeviceBackend, Placement, device_backend_for
from .dtypes import dtype_name


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
    #: device memory: its GPU and the stream that produced it
    where: Optional[Placement] = None

    @property
    def on_device(self) -> bool:
        return self.host is None


def _numpy_buffer(arr: np.ndarray, obj, kind, wrap) -> Buffer:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{kind} buffer of shape {arr.shape} is not C-contiguous; pass a "
                         "contiguous copy (numpy.ascontiguousarray / tensor.contiguous())")
    name = dtype_name(arr.dtype)
    flat = arr.reshape(-1)
    if name == "bfloat16":  # ml_dtypes.bfloat16: carried as uint16 bit patterns
        flat = flat.view(np.uint16)
        inner, user_dtype = wrap, arr.dtype

        def wrap(res):
            return inner(res.view(user_dtype))
    return Buffer(obj=obj, kind=kind, shape=tuple(arr.shape), dtype=name, size=flat.size,
                  host=flat, wrap=wrap)


def _torch_buffer(t, where) -> Buffer:
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
                      device=flat, backend=backend, wrap=wrap_cuda,
                      where=where or backend.placement(flat))
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


def _cai_buffer(obj, kind, where) -> Buffer:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dt = np.dtype(cai["typestr"])
    name = dtype_name(dt)
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
                  backend=backend, wrap=wrap_dev, where=where or backend.placement(obj))


def as_buffer(x: Any, where: Optional[Placement] = None) -> Buffer:
    """Describe ``x`` as a :class:`Buffer`.  Raises ``TypeError`` for objects
    or dtypes hpccomm cannot reduce and ``ValueError`` for non-contiguous ones.
    ``where``: the placement of device memory when known already (as
    :func:`placement_of` said on the thread that produced ``x``); else the
    backend is asked now."""
    if isinstance(x, np.ndarray):
        shape = x.shape
        return _numpy_buffer(x, x, "numpy", lambda res: res.reshape(shape))
    module = type(x).__module__ or ""
    if module.startswith("torch") and hasattr(x, "is_cuda"):
        return _torch_buffer(x, where)
    if module.startswith("cupy"):
        return _cai_buffer(x, "cupy", where)
    if hasattr(x, "__cuda_array_interface__"):
        return _cai_buffer(x, "cuda", where)
    if hasattr(x, "__dlpack__"):
        try:
            arr = np.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError) as exc:
            raise TypeError(f"cannot read {type(x).__name__} through DLPack: {exc}") from exc
        shape = arr.shape
        return _numpy_buffer(arr, x, "dlpack", lambda res: res.reshape(shape))
    raise TypeError(f"cannot reduce a {type(x).__name__}: pass a numpy array, a torch tensor, "
                    "a CuPy array or an object with __cuda_array_interface__")


def placement_of(x: Any) -> Optional[Placement]:
    """Where device memory ``x`` lives and the stream that produced it, as
    this thread sees it; None for host memory, and for anything
    :func:`as_buffer` would refuse (it raises then, where errors are agreed
    on)."""
    if isinstance(x, np.ndarray):
        return None
    is_torch = (type(x).__module__ or "").startswith("torch")
    if not (getattr(x, "is_cuda", False) if is_torch else
            hasattr(x, "__cuda_array_interface__")):
        return None
    try:
        return device_backend_for(x).placement(x)
    except Exception:  # noqa: BLE001 - as_buffer raises it again, collectively
        return None
