"""numba's CUDA simulator, made to behave like a GPU where hpccomm's device
code could tell the difference, and a way to run checks on it.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is imported, so the
simulator tests run in processes that have it set: each check function of
``tests/test_cuda_*.py`` in a process of its own (:func:`run_check`), the
MPI tests marked ``cudasim`` under ``tests/run.py`` (``conftest.py``
installs the harness there), and ``./dev.sh gpu --simulate``, which runs
the benchmarks through ``python tests/cudasim.py -m MODULE ARGS``.

:func:`install` closes the gaps between the simulator and a GPU that hid
real failures:

* **Kernels bind like dispatchers.**  A real ``CUDADispatcher`` has
  ``__get__``: stored as a class attribute and read from an instance it
  becomes a bound method, which cannot be configured for a launch.  The
  simulator's ``FakeCUDAKernel`` had none, so every simulator test passed
  while every dense twin failed on an H100.  It gets the dispatcher's
  ``__get__`` here.
* **Host-side arrays have only a device array's attributes.**  The
  simulator's ``FakeCUDAArray`` hands any attribute it lacks to the numpy
  array behind it (``.copy()``, ``.sum()`` ...), which numba's
  ``DeviceNDArray`` does not have.  Outside a kernel, an attribute that
  :data:`DEVICE_ARRAY_API` (numba's ``DeviceNDArray``, checked against the
  real class by ``tests/test_cuda_harness.py``) does not list raises.
* **Streams exist and are recorded.**  The simulator ignores the stream of
  a launch and has no external streams.  Here ``cuda.external_stream(h)``
  gives a :class:`SimStream` with handle ``h``, and every launch, copy and
  allocation notes the stream it was given while :func:`record_streams` is
  active, and so does every event recorded on a stream or waited for by one
  (``"event record"``, ``"event wait"``), so a test can demand that a call ran
  all of its work on the stream of its input, after what it had to wait for.

* **A block's shared arrays are one array.**  The simulator makes a shared
  array on the first call of ``cuda.shared.array`` from a source line with a
  check-then-set that two threads of the block can both pass, each then
  working on an array of its own; here the allocation is atomic.
* **A missing barrier shows.**  The threads of a block take turns between
  barriers in ``threadIdx`` order in one phase and in the reverse order in
  the next, and the other way round in the next block
  (:func:`_block_runner`): a thread that reads what another writes without
  a barrier between them reads it in some blocks and not in others.

It also makes the simulator fast enough to use.  numba-cuda's simulator
starts a Python thread per CUDA thread and polls them for their barriers,
which was most of the time of a launch; here a block's CUDA threads are
greenlets (the ``greenlet`` package) that one Python thread resumes in
turn, each running to its next ``syncthreads()`` or its end.
"""
import contextlib
import functools
import os
import runpy
import subprocess
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}

#: what numba's ``DeviceNDArray`` offers on the host: its public class
#: attributes and the attributes its ``__init__`` sets
DEVICE_ARRAY_API = frozenset([
    "T", "as_cuda_arg", "bind", "copy_to_device", "copy_to_host", "device_ctypes_pointer",
    "flags", "get_ipc_handle", "getitem", "is_c_contiguous", "is_f_contiguous", "nbytes",
    "ravel", "reshape", "setitem", "split", "squeeze", "transpose", "view",
    "alloc_size", "dtype", "gpu_data", "ndim", "shape", "size", "stream", "strides",
])

#: the streams recorded by :func:`record_streams` (None: not recording)
_RECORD = [None]


class SimStream:
    """An external stream in the simulator: it only has a handle (work runs
    at once, in order, as on the simulator's other streams)."""

    def __init__(self, handle):
        self.handle = int(handle)

    def synchronize(self):
        pass

    @contextlib.contextmanager
    def auto_synchronize(self):
        yield

    def __repr__(self):
        return f"<SimStream {self.handle:#x}>"


@contextlib.contextmanager
def record_streams():
    """Collect ``(what, stream)`` of every launch, copy and allocation in the
    ``with`` block; yields the list."""
    log = []
    _RECORD[0] = log
    try:
        yield log
    finally:
        _RECORD[0] = None


def _note(what, stream):
    if _RECORD[0] is not None:
        _RECORD[0].append((what, stream))


def install() -> None:
    """Patch the simulator as the module docstring says (once per process)."""
    from numba import config, cuda

    assert config.ENABLE_CUDASIM, "the harness patches numba's simulator: NUMBA_ENABLE_CUDASIM=1"
    from numba.cuda.simulator import kernel as K
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.cudadrv import devicearray as D

    kernel_cls, array_cls = K.FakeCUDAKernel, D.FakeCUDAArray
    if getattr(kernel_cls, "_hpccomm_harness", False):
        return
    kernel_cls._hpccomm_harness = True

    def __get__(self, obj, objtype=None):       # numba's _DispatcherBase.__get__
        return self if obj is None else types.MethodType(self, obj)

    kernel_cls.__get__ = __get__

    configure = kernel_cls.__getitem__

    def __getitem__(self, launch):
        _note(f"launch {getattr(self.fn, '__name__', '?')}", launch[2] if len(launch) > 2 else 0)
        return configure(self, launch)

    kernel_cls.__getitem__ = __getitem__

    delegate = array_cls.__getattr__

    def __getattr__(self, name):
        if K._kernel_context is None and not name.startswith("__") \
                and name not in DEVICE_ARRAY_API:
            raise AttributeError(f"numba's DeviceNDArray has no attribute {name!r} (the "
                                 f"simulator's array would take it from numpy)")
        return delegate(self, name)

    array_cls.__getattr__ = __getattr__

    def recorded(what, fn, position):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            stream = kwargs.get("stream", args[position] if len(args) > position else 0)
            _note(what, stream)
            return fn(*args, **kwargs)
        return wrapper

    array_cls.copy_to_host = recorded("copy_to_host", array_cls.copy_to_host, 2)
    array_cls.copy_to_device = recorded("copy_to_device", array_cls.copy_to_device, 2)
    cuda.to_device = recorded("to_device", cuda.to_device, 1)
    allocate = cuda.device_array

    @functools.wraps(allocate)
    def device_array(*args, **kwargs):
        _note("device_array", kwargs.get("stream", 0))
        return allocate(*args, **kwargs)

    cuda.device_array = device_array
    cuda.external_stream = SimStream

    class Event(cuda.event):
        def record(self, stream=0):
            _note("event record", stream)
            return super().record(stream)

        def wait(self, stream=0):
            _note("event wait", stream)
            return super().wait(stream)

    cuda.event = Event

    allocate_shared = kernelapi.FakeCUDAShared.array

    def shared_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:     # dynamic shared memory, or refused
            return allocate_shared(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):  # numba's int64 ..., as the simulator does
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)                      # the kernel's line, as the simulator keys it
        caller = (frame.f_code.co_filename, frame.f_lineno)
        return self._allocations.setdefault(caller, np.empty(shape, dtype))

    kernelapi.FakeCUDAShared.array = shared_array
    K.BlockManager.run = _block_runner(K)


def _named(exc, thread):
    """``exc`` with the thread that raised it in its message, as the
    simulator names it (``tid=[..] ctaid=[..]: message``); a RuntimeError
    where the exception's type takes other arguments than a message (the
    simulator's own runner then loses the exception, and the launch passes)."""
    where = f"tid={list(thread.threadIdx)} ctaid={list(thread.blockIdx)}"
    try:
        return type(exc)(f"{where}: {exc}" if str(exc) else where)
    except Exception:
        return RuntimeError(f"{where}: {type(exc).__name__}: {exc}")


def _block_runner(K):
    """numba-cuda's ``BlockManager.run`` (``K``: ``numba.cuda.simulator.kernel``)
    with the CUDA threads of a block run as greenlets on one Python thread,
    in place of a Python thread per CUDA thread (whose start, and the
    block's polling of them, were most of a simulated launch).

    The block runs in phases: each thread still running is resumed once,
    and runs to its next barrier (``syncthreads()`` and the simulator's
    ``syncthreads_count`` / ``_and`` / ``_or``, which call it) or to its
    end; the next phase starts when every thread of the block has.  That is
    ``syncthreads()``'s contract (a thread that has returned is not waited
    for), and one schedule a GPU may run.  The threads of a phase take turns
    in ``threadIdx`` order in one phase and in the reverse order in the next
    (and the other way round in the next block), so that a thread reading
    what another writes in the same phase -- a race, a missing barrier --
    reads it in some blocks and not in others, and the results differ from
    the host's.  The first thread that raises ends its block; the others are
    unwound, and the launch raises its exception, named."""
    from greenlet import getcurrent, greenlet

    class GreenBlock(K.BlockThread):
        """One block, as this Python thread (``threading.current_thread()``
        for the simulator's ``cuda.threadIdx`` ...), which sets the
        ``threadIdx`` of each CUDA thread before resuming its greenlet."""

        def __init__(self, target, manager, grid_point, debug):
            super().__init__(target, manager, grid_point, (0, 0, 0), debug)
            gx, gy, _ = manager._grid_dim
            x, y, z = grid_point
            self.flip = (x + gx * (y + gy * z)) % 2

        def run(self):
            bx, by, bz = self._manager._block_dim
            who = [(K.Dim3(x, y, z), x + bx * (y + by * z))
                   for z in range(bz) for y in range(by) for x in range(bx)]
            threads = [greenlet(self._target) for _ in who]
            live, phase = list(range(len(who))), self.flip
            while live:
                waiting = []
                for i in (live if phase % 2 == 0 else reversed(live)):
                    self.threadIdx, self.thread_id = who[i]
                    try:
                        threads[i].switch()
                    except Exception as e:
                        self.exception = (_named(e, self), sys.exc_info()[2])
                        for t in threads:
                            if t:                       # started, not finished
                                t.throw()               # GreenletExit: unwound
                        return
                    if not threads[i].dead:
                        waiting.append(i)
                live, phase = sorted(waiting), phase + 1

        def syncthreads(self):
            getcurrent().parent.switch()

    def run(self, grid_point, *args):
        block = GreenBlock(lambda: self._f(*args), self, grid_point, self._debug)
        block.start()
        block.join()
        if block.exception is not None:
            raise block.exception[0].with_traceback(block.exception[1])

    return run


def simulator_missing() -> str:
    """Why the simulator cannot run here, or '' when it can."""
    return _simulator_missing(sys.executable)


@functools.lru_cache(maxsize=None)
def _simulator_missing(python) -> str:
    probe = subprocess.run([python, "-c", "from numba import cuda; cuda.to_device"],
                           env=ENV, capture_output=True, text=True, timeout=120)
    return "" if probe.returncode == 0 else probe.stderr.strip()[-200:]


#: this process's zygote (:func:`run_check`), once started
_ZYGOTE = []


def run_check(module: str, check: str, timeout: int = 300) -> None:
    """Run ``tests.<module>.<check>()`` on the simulator, with the harness
    installed, in a process of its own; fail with its output.

    The process is forked from a zygote (:func:`zygote`, started on this
    process's first check) that has installed the harness, imported hpccomm
    and its device kernels and loaded a CPU kernel once: each check starts
    from that state, untouched by the checks before it, without paying
    for it (1.5 s of imports, and numba's first kernel load)."""
    import pytest

    if simulator_missing():
        pytest.skip(f"numba.cuda simulator unavailable: {simulator_missing()}")
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        _ZYGOTE[:] = [subprocess.Popen(
            [sys.executable, "-c", "from tests.cudasim import zygote; zygote()"], cwd=ROOT,
            env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)]
    proc = _ZYGOTE[0]
    proc.stdin.write(f"{module} {check} {timeout}\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().split(" ", 1)
    assert len(reply) == 2, f"the simulator's zygote ended (exit {proc.wait()})"
    rc, path = int(reply[0]), reply[1].strip()
    with open(path, encoding="utf-8", errors="replace") as f:
        output = f.read()
    os.remove(path)
    assert rc == 0, output


def zygote() -> None:
    """:func:`run_check`'s zygote: for each line ``MODULE CHECK TIMEOUT`` on
    stdin, fork a child that runs ``tests.<MODULE>.<CHECK>()`` with its
    output in a file; answer ``EXIT_CODE PATH`` on stdout (124 when the
    child was killed after ``TIMEOUT`` seconds). Ends with stdin.  The
    answers go out on a copy of stdout made first; stdout itself then goes
    to stderr, so that nothing an import prints can garble them."""
    import importlib
    import signal
    import tempfile
    import time
    import traceback

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    install()
    for name in ("hpccomm.device_codecs", "hpccomm.buffers.host_device"):
        importlib.import_module(name)             # the device kernels, imported once
    from hpccomm.kernels.nonfinite import count_nonfinite

    count_nonfinite(np.zeros(1, np.float32))      # numba's registries, loaded once
    for line in sys.stdin:
        module, check, timeout = line.split()
        fd, path = tempfile.mkstemp(prefix="hpccomm-check-", suffix=".log")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                answers.close()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                getattr(importlib.import_module(f"tests.{module}"), check)()
                code = 0
            except BaseException:       # noqa: BLE001 -- reported in the output
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(fd)
        deadline = time.monotonic() + float(timeout)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                with open(path, "a", encoding="utf-8") as f:
                    f.write(f"\ntimed out after {timeout} s\n")
                code = 124
                break
            time.sleep(0.005)
        print(code, path, file=answers)


def main(argv) -> None:
    """``python tests/cudasim.py -m MODULE ARGS...``: run a module as
    ``python -m`` would, on the simulator with the harness installed."""
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: NUMBA_ENABLE_CUDASIM=1 python tests/cudasim.py -m MODULE ARGS...")
    install()
    sys.argv = [argv[1]] + list(argv[2:])
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1:])
