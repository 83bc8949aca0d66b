"""Guards for what numba's CUDA simulator hides (``tests/cudasim.py``).

* numba.cuda kernels stored in classes: no CUDA dispatcher of hpccomm may
  be a plain class attribute (read from an instance, it binds as a method
  and cannot be launched), scanned over every class of every hpccomm
  module, with real dispatchers (plain interpreter) and with the
  simulator's kernels (the harness binds them the same way);
* the launch helpers refuse a bound method, naming the fix;
* the harness itself: its picture of numba's ``DeviceNDArray`` is the real
  class's, and a kernel stored as a plain class attribute fails under it
  the way it fails on a GPU;
* the harness's block runner (a block's CUDA threads as greenlets, in
  phases between barriers): kernels with and without barriers (through a
  device function too, and ``syncthreads_count``) give the GPU's answers,
  a read of what another thread writes in the same phase differs between
  blocks (the race shows), and a thread that raises is named;
* a numpy that numba-cuda cannot compile kernels with (numpy 2.5 removed
  ``np.row_stack``; the simulator compiles nothing, so only a GPU showed
  it) is refused when the kernels are imported, with the fix in the message.

No GPU is needed: numba creates dispatchers without compiling them.
"""
import functools
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys

import pytest
from numba import cuda

from .cudasim import DEVICE_ARRAY_API, run_check

_run = functools.partial(run_check, "test_cuda_harness")

#: hpccomm modules that need what a test machine may lack (skipped by the scan)
OPTIONAL = ("torch", "sklearn", "matplotlib", "mnist1d", "cupy")


def _is_dispatcher(value) -> bool:
    from numba import config

    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        return isinstance(value, FakeCUDAKernel)
    from numba.cuda.dispatcher import CUDADispatcher

    return isinstance(value, CUDADispatcher)


def dispatchers_as_class_attributes():
    """``(module.Class.name, ...)`` of every CUDA dispatcher held as a plain
    class attribute by a class defined in hpccomm; and the modules that could
    not be imported for want of an optional package."""
    import hpccomm

    found, skipped = [], []
    for info in pkgutil.walk_packages(hpccomm.__path__, "hpccomm."):
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:
            if getattr(exc, "name", None) and exc.name.split(".")[0] in OPTIONAL:
                skipped.append(info.name)
                continue
            raise
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if not cls.__module__.startswith("hpccomm"):
                continue
            for attr, value in vars(cls).items():
                if _is_dispatcher(value):
                    found.append(f"{cls.__module__}.{cls_name}.{attr}")
    return sorted(set(found)), skipped


def test_no_cuda_dispatcher_is_a_plain_class_attribute():
    """Real dispatchers (a plain interpreter: numba.cuda without a GPU)."""
    found, _ = dispatchers_as_class_attributes()
    assert not found, ("numba.cuda kernels stored as plain class attributes bind as methods on "
                       f"a GPU (wrap them in staticmethod): {found}")


def check_no_dispatcher_is_a_plain_class_attribute():
    found, _ = dispatchers_as_class_attributes()
    assert not found, found


def test_no_simulated_kernel_is_a_plain_class_attribute():
    _run("check_no_dispatcher_is_a_plain_class_attribute")


@cuda.jit
def kernel(a):
    """A kernel for the checks here (module level: the simulator gives a
    kernel its fake ``cuda`` through the module's globals)."""
    i = cuda.grid(1)
    if i < a.size:
        a[i] = a.size          # an array attribute inside a kernel: numpy's


def test_the_scan_finds_a_plain_class_attribute():
    """The scan's detector sees a dispatcher stored plainly, and not one
    wrapped in staticmethod."""
    plain = type("Plain", (), {"k": kernel})
    wrapped = type("Wrapped", (), {"k": staticmethod(kernel)})
    assert [a for a, v in vars(plain).items() if _is_dispatcher(v)] == ["k"]
    assert not [a for a, v in vars(wrapped).items() if _is_dispatcher(v)]


def test_launch_helpers_refuse_a_bound_method():
    """A dispatcher read from an instance is a bound method: each launch
    helper refuses it with the fix in the message (before any CUDA call, so
    no GPU is needed)."""
    from hpccomm.kernels import cuda_util as U

    holder = type("Holder", (), {"k": kernel})()
    bound = holder.k
    assert inspect.ismethod(bound)
    for call in (lambda: U.launch(32, bound, 10, None), lambda: U.launch_grid(32, bound, 10, None),
                 lambda: U.single(bound, None)):
        with pytest.raises(TypeError, match=r"kernel 'kernel' was read from an instance of "
                                            r"Holder.*staticmethod"):
            call()


def test_a_numpy_without_row_stack_is_refused_at_import():
    """numba-cuda 0.30.4 compiles no kernel with numpy 2.5, which removed
    ``np.row_stack`` (every kernel of an H200 run failed so).  Here numpy
    loses ``row_stack`` before hpccomm's kernels are imported, in a fresh
    interpreter without the simulator: the import raises ImportError naming
    the fix; without the probe it would import, and fail at the first
    kernel."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    script = ("import numpy as np\n"
              "if hasattr(np, 'row_stack'):\n"
              "    del np.row_stack\n"
              "try:\n"
              "    import hpccomm.kernels.cuda_util\n"
              "except ImportError as exc:\n"
              "    print('ImportError:', exc)\n"
              "else:\n"
              "    print('imported')\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ImportError: hpccomm's GPU kernels cannot compile"), \
        done.stdout + done.stderr[-2000:]
    assert "numpy<2.5" in done.stdout and "numba-cuda#907" in done.stdout


def test_device_array_api_is_numbas():
    """The harness lets host code use exactly what numba's real
    ``DeviceNDArray`` offers: its public class attributes and the attributes
    its ``__init__`` sets."""
    from numba.cuda.cudadrv import devicearray

    cls = devicearray.DeviceNDArray
    public = {a for a in dir(cls) if not a.startswith("_")}
    init = set(re.findall(r"self\.([a-z]\w*)\s*=",
                          inspect.getsource(devicearray.DeviceNDArrayBase.__init__)))
    assert DEVICE_ARRAY_API == public | init
    assert "copy" not in DEVICE_ARRAY_API


def check_harness_binds_and_restricts():
    """Under the harness: a kernel stored plainly in a class fails to launch
    as on a GPU (and works through staticmethod); a device array has no
    numpy-only attribute outside kernels, all of numpy's inside them."""
    import numpy as np

    from hpccomm.kernels import cuda_util as U

    d = cuda.to_device(np.zeros(5, np.float32))
    plain = type("Plain", (), {"k": kernel})()
    wrapped = type("Wrapped", (), {"k": staticmethod(kernel)})()
    try:
        plain.k[1, 8](d)
    except TypeError as exc:
        assert "not subscriptable" in str(exc), exc
    else:
        raise AssertionError("a plainly stored kernel launched under the harness")
    U.launch(8, wrapped.k, 5, d)
    assert U.to_host(d).tolist() == [5.0] * 5
    try:
        d.copy()
    except AttributeError as exc:
        assert "DeviceNDArray has no attribute 'copy'" in str(exc), exc
    else:
        raise AssertionError("the harness let a device array take numpy's copy()")


def test_harness_binds_and_restricts():
    _run("check_harness_binds_and_restricts")


@cuda.jit
def thread_ids(out):
    """No barrier: each thread writes who it is."""
    i = cuda.grid(1)
    out[i] = cuda.threadIdx.x * 1000 + cuda.blockIdx.x


@cuda.jit(device=True)
def block_sum(shared, value):
    """The sum of ``value`` over a block of a power-of-two size, by halving
    behind barriers."""
    t = cuda.threadIdx.x
    shared[t] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step:
        if t < step:
            shared[t] += shared[t + step]
        cuda.syncthreads()
        step //= 2
    return shared[0]


@cuda.jit
def block_sums(x, out):
    """A barrier reached only through a device function."""
    shared = cuda.shared.array(16, "float64")
    total = block_sum(shared, x[cuda.grid(1)])
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = total


class TwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


@cuda.jit
def fails_at(out, bad, plain):
    i = cuda.grid(1)
    if i == bad:
        if plain:
            raise ValueError("planted")
        raise TwoArguments(1, 2)
    out[i] = 1


@cuda.jit
def fails_after_a_barrier(out, bad):
    i = cuda.grid(1)
    cuda.syncthreads()
    if i == bad:
        raise TwoArguments(3, 4)
    out[i] = 1


@cuda.jit
def counts_positive(x, out):
    """``syncthreads_count``: the threads of the block with a positive value."""
    n = cuda.syncthreads_count(x[cuda.grid(1)] > 0)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = n


@cuda.jit
def reads_a_neighbour_unsynchronized(buf, out):
    """A missing barrier: each thread writes its slot of its block's part of
    ``buf`` (zeros before), then reads the next thread's in the same phase."""
    t, base = cuda.threadIdx.x, cuda.blockIdx.x * cuda.blockDim.x
    buf[base + t] = t + 1
    out[base + t] = buf[base + (t + 1) % cuda.blockDim.x]


def check_block_runner():
    """Under the harness: kernels with and without barriers (one behind a
    device function) give what a GPU gives; a race between the threads of a
    phase shows as blocks that disagree; the thread that raised is named,
    also when its exception's type takes other arguments than a message."""
    import numpy as np

    ids = cuda.to_device(np.zeros(4 * 8, np.int64))
    thread_ids[4, 8](ids)
    want = [t * 1000 + b for b in range(4) for t in range(8)]
    assert ids.copy_to_host().tolist() == want
    x = np.arange(3 * 16, dtype=np.float64) ** 2
    sums = cuda.to_device(np.zeros(3))
    block_sums[3, 16](cuda.to_device(x), sums)
    assert sums.copy_to_host().tolist() == x.reshape(3, 16).sum(axis=1).tolist()
    signs = np.array([1, -1, 2, 0, 3, 4, -5, 6] * 2, np.float64) * np.repeat([1, -1], 8)
    counts = cuda.to_device(np.zeros(2, np.int64))
    counts_positive[2, 8](cuda.to_device(signs), counts)
    assert counts.copy_to_host().tolist() == [5, 2]
    raced = cuda.to_device(np.zeros(2 * 8, np.int64))
    reads_a_neighbour_unsynchronized[2, 8](cuda.to_device(np.zeros(2 * 8, np.int64)), raced)
    unwritten = (raced.copy_to_host().reshape(2, 8) == 0).tolist()
    assert unwritten[0] != unwritten[1], f"blocks raced the same way: {unwritten}"
    for plain, kind, text in ((True, ValueError, "planted"),
                              (False, RuntimeError, "TwoArguments: 1 and 2")):
        try:
            fails_at[2, 8](cuda.to_device(np.zeros(16, np.int64)), 11, plain)
        except kind as exc:
            assert str(exc) == f"tid=[3, 0, 0] ctaid=[1, 0, 0]: {text}", exc
        else:
            raise AssertionError(f"a raising thread went unnoticed ({text})")
    try:
        fails_after_a_barrier[2, 8](cuda.to_device(np.zeros(16, np.int64)), 11)
    except RuntimeError as exc:
        assert str(exc) == "tid=[3, 0, 0] ctaid=[1, 0, 0]: TwoArguments: 3 and 4", exc
    else:
        raise AssertionError("a raising thread behind a barrier went unnoticed")


def test_block_runner():
    _run("check_block_runner")
