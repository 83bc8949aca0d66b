"""What every benchmark command shares: sizes and options on the command
line, routing options to each (codec, algorithm) case, the buffer kinds the
benchmarks hand to the collectives, and the slowest-rank timing rule.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from typing import FrozenSet, List, Optional, Tuple

import numpy as np

from ..options import resolve_options

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)(i?[bB]?)\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' / '4KiB' / '1M' / '4096' -> bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 4K, 64M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_range(text: str) -> Tuple[int, int]:
    if ":" in text:
        lo, hi = text.split(":", 1)
        lo_b = parse_size(lo) if lo else 4
        hi_b = parse_size(hi)
    else:
        lo_b = 4
        hi_b = parse_size(text)
    if lo_b < 4 or hi_b < lo_b:
        raise argparse.ArgumentTypeError(f"bad size range {text!r}: need 4 <= MIN <= MAX")
    return lo_b, hi_b


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.4g}{unit}"
        n /= 1024.0
    return f"{n}"


def sizes_from(lo: int, hi: int, factor: float) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(int(s) // 4 * 4)
        s = s * factor
    return sorted(set(max(4, v) for v in out))


def option_value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    return text


def parse_options(items) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--option takes KEY=VALUE, not {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = option_value(v.strip())
    return out


def case_options(codec, algorithm: str, options: dict) -> dict:
    """The options of one (codec, algorithm) case, merged into one dict:
    ``KEY`` applies where the codec or the algorithm takes it,
    ``CODEC.KEY`` / ``ALGORITHM.KEY`` to that one only
    (:func:`hpccomm.options.resolve_options`, not strict)."""
    codec_opts, alg_opts = resolve_options(codec, algorithm, options, strict=False)
    return {**codec_opts, **alg_opts}


def mpi_library() -> str:
    from mpi4py import MPI

    text = MPI.Get_library_version().strip().splitlines()[0]
    return re.sub(r"\s+", " ", text)


def mpi_thread_level() -> str:
    """The thread support MPI was initialised with (mpi4py asks for
    ``multiple`` unless ``MPI4PY_RC_THREAD_LEVEL`` says otherwise)."""
    from mpi4py import MPI

    level = MPI.Query_thread()
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(level, str(level))


#: the CPUs this process might use before :func:`bind_to_core` pinned it
_CPUS_BEFORE_BINDING: Optional[FrozenSet[int]] = None


def allowed_cpus() -> FrozenSet[int]:
    """The CPUs this process may run on now (all of them off Linux)."""
    if not hasattr(os, "sched_getaffinity"):     # pragma: no cover (not Linux)
        return frozenset(range(os.cpu_count() or 1))
    return frozenset(os.sched_getaffinity(0))


def bind_to_core(rank: int) -> Optional[int]:
    """Pin this process to one CPU when ``HPCCOMM_BENCH_BIND=core``: the
    ``rank mod count``-th of the CPUs it may use, ``rank`` being its rank in
    the launch.  Returns that CPU (None when unset or ``none``).

    Where ranks outnumber the cores, an unbound launch lets the scheduler
    place them anew each time: measured here, 3 ranks on 2 cores ran a
    64 KiB ``MPI_Allreduce`` in 48 us in one launch and 85 us in the next,
    stable within each.  A calibration and the sweep it predicts are two
    launches, so both bind.  The launch-wide rank (not the node-local one)
    makes this work across ``bench netem``'s namespaces, which emulate hosts
    on the same cores; a launcher that binds already (``mpiexec -bind-to
    core``, ``srun --cpu-bind=cores``) leaves one CPU here, kept as it is."""
    global _CPUS_BEFORE_BINDING
    how = os.environ.get("HPCCOMM_BENCH_BIND", "none").strip().lower()
    if how not in ("none", "core", ""):
        raise SystemExit(f"HPCCOMM_BENCH_BIND={how!r}: use 'core' or 'none'")
    if how != "core" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(allowed_cpus())
    if _CPUS_BEFORE_BINDING is None:
        _CPUS_BEFORE_BINDING = frozenset(cpus)
    cpu = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def node_cores(comm) -> int:
    """The CPUs that the ranks on this rank's node (``MPI_COMM_TYPE_SHARED``)
    may use together: the union of their affinities, each taken before
    :func:`bind_to_core` pinned it.  A launcher that binds each rank to
    one core still counts the node's cores, not one.  Collective."""
    from mpi4py import MPI

    mine = _CPUS_BEFORE_BINDING if _CPUS_BEFORE_BINDING is not None else allowed_cpus()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return len(frozenset().union(*node.allgather(mine)))
    finally:
        node.Free()


def slowest_rank(comm, times):
    from mpi4py import MPI

    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest


def slowest_median(comm, fn, reps, excluded=None, warmup=1):
    """The median over ``reps`` calls of ``fn`` (after ``warmup`` more,
    untimed) of the slowest rank's seconds per call, each call started after
    a barrier.  ``excluded``: a running count of seconds (read before and
    after each call) whose growth is taken off the call's time."""
    for _ in range(warmup):
        fn()
    ts = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        before = excluded() if excluded is not None else 0.0
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
        if excluded is not None:
            ts[i] -= excluded() - before
    return float(np.median(slowest_rank(comm, ts)))


#: ``--buffer`` kinds: numpy, torch (``--device cpu|cuda``), CuPy, and ``sim``
#: (host memory as a CUDA array: the device path under numba's CUDA
#: simulator, :mod:`hpccomm.buffers.host_device`)
BUFFERS = ("numpy", "torch", "cupy", "sim")


def empty_like(x):
    from ..buffers.host_device import HostDeviceArray

    if isinstance(x, HostDeviceArray):
        return HostDeviceArray(np.empty_like(x.host))
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        return torch.empty_like(x)
    if mod.startswith("cupy"):
        import cupy

        return cupy.empty_like(x)
    return np.empty_like(x)


def to_numpy(x):
    from ..buffers.host_device import HostDeviceArray

    if isinstance(x, HostDeviceArray):
        return x.host
    mod = type(x).__module__
    if mod.startswith("torch"):
        return x.detach().cpu().numpy()
    if mod.startswith("cupy"):
        return x.get()
    return x


def make_buffer(x: np.ndarray, kind: str, device: str = "cpu"):
    """The benchmark input as the requested buffer type (``torch`` on
    ``device``: "cpu" or "cuda"; ``cupy`` is always on the GPU; ``sim``:
    host memory as a CUDA array, served by a
    :class:`~hpccomm.buffers.host_device.HostDeviceBackend` registered here
    whose kernels run under numba's simulator when it is on)."""
    if kind == "torch":
        import torch

        t = torch.from_numpy(x)
        return t.to(device) if device != "cpu" else t
    if kind == "cupy":
        import cupy

        return cupy.asarray(x)
    if kind == "sim":
        from numba import config

        from ..buffers import device_backend_for, register_device_backend
        from ..buffers.host_device import HostDeviceArray, HostDeviceBackend

        arr = HostDeviceArray(np.ascontiguousarray(x))
        try:
            device_backend_for(arr)
        except TypeError:
            register_device_backend(HostDeviceBackend(device_kernels=config.ENABLE_CUDASIM))
        return arr
    return x


def on_device(x) -> bool:
    """Whether benchmark buffer ``x`` is device memory (to MPI: only through
    a CUDA-aware library)."""
    return not isinstance(x, np.ndarray) and not (type(x).__module__.startswith("torch")
                                                  and not x.is_cuda)


def host_staging(x):
    """For device buffer ``x``: ``(host, to_host, from_host)``, a flat pinned
    float32 host buffer of its size and the copies into it from ``x`` and
    out of it into a device buffer like ``x`` -- what a user of a host-only MPI
    writes around ``MPI_Allreduce``."""
    from ..buffers.host_device import HostDeviceArray

    if isinstance(x, HostDeviceArray):
        def to_host(src, host):
            host[...] = src.host.reshape(-1)

        def from_host(host, dst):
            dst.host.reshape(-1)[...] = host

        return np.empty(x.host.size, np.float32), to_host, from_host
    if type(x).__module__.startswith("torch"):
        import torch

        host = torch.empty(x.numel(), dtype=torch.float32, pin_memory=True)

        def to_host(src, h):
            torch.from_numpy(h).copy_(src.reshape(-1))

        def from_host(h, dst):
            dst.reshape(-1).copy_(torch.from_numpy(h))

        return host.numpy(), to_host, from_host
    import cupyx

    host = cupyx.empty_pinned(x.size, np.float32)

    def to_host(src, h):
        src.reshape(-1).get(out=h)

    def from_host(h, dst):
        dst.reshape(-1).set(h)

    return host, to_host, from_host


def device_sync(x) -> None:
    """Wait for the GPU work queued on ``x``'s current stream (a no-op for
    host buffers): benchmark times of device buffers end when the result is
    there, not when the last kernel was queued."""
    mod = type(x).__module__
    if mod.startswith("cupy"):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    elif mod.startswith("torch") and x.is_cuda:
        import torch

        torch.cuda.current_stream(x.device).synchronize()
