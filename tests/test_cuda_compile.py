"""Every ``numba.cuda`` kernel of hpccomm compiles for a real GPU, and its
floating point is the CPU's.

The simulator tests (``tests/test_cuda_*.py``) run the kernels as Python
with plain IEEE arithmetic: they check the bits against the CPU codecs but
never type the kernels for the CUDA target, and never see what NVVM makes of
the arithmetic.  Here every kernel (``@cuda.jit`` non-device function) of
:mod:`hpccomm.kernels.cuda_util`, :mod:`~hpccomm.kernels.cuda_quantize`,
:mod:`~hpccomm.kernels.cuda_sparsify` and :mod:`~hpccomm.kernels.cuda_select`
is compiled to sm_90 PTX (the toolkit's NVVM; no GPU needed) with the
GPU geometry, for each argument-type variant the device twins
(:mod:`hpccomm.device_codecs`) and the kernels' host wrappers launch it
with, and the PTX is rejected when it holds

* ``fma.`` -- a product and a sum fused into one rounding;
* ``mul.f32`` / ``mul.f64`` without ``.rn`` -- a product NVVM / ptxas may
  still contract with an addition (products that feed an addition go
  through ``cuda_util.fmul_rn`` / ``dmul_rn``, libdevice's ``mul.rn``, and
  so do the others: stating a product as ``mul.rn`` costs nothing).  One
  exception, exact whatever NVVM does with it: the counter-based uniform
  ``float32(z >> 40) * 2**-24`` of :func:`hpccomm.kernels.rng.uniform01`
  (the very source the CPU compiles, so it keeps the plain ``*``) -- a
  ``mul.f32`` by ``0f33800000`` of a ``cvt.rn.f32.u64`` of a ``shr.u64`` by
  40 or more: an integer below ``2**24`` converts exactly and its product
  with a power of two in range is exact, so fused or not the bits are the
  same;
* ``.ftz`` -- subnormals flushed to zero.

The kernels are found by introspection: one without a signature here fails
the test, and so does a device function of the module that none of the
kernels compiled (cuda_util's device functions, called from the other
modules, compile on their own here).  Each module compiles in a fresh
interpreter without ``NUMBA_ENABLE_CUDASIM`` (the simulator replaces
numba.cuda's compiler, and its thread counts are not the GPU's); the tests
skip, with the reason, when NVVM is not available.
"""
import functools
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
MODULES = ["cuda_util", "cuda_quantize", "cuda_sparsify", "cuda_select"]
#: PTX instructions the kernels must not hold (see the module docstring)
LOOSE = re.compile(r"^\s*(?:@!?%p\d+\s+)?"
                   r"(?:fma\.|mad\.\S*f(?:32|64)\b|mul\.(?!rn\.)\S*f(?:32|64)\b)|\.ftz\b")


@functools.lru_cache(maxsize=None)
def _nvvm_missing():
    """Why NVVM cannot compile here, or '' when it can."""
    probe = subprocess.run([sys.executable, "-c", "from numba.cuda.cudadrv import nvvm; "
                            "nvvm.NVVM().get_version()"], env=ENV, capture_output=True,
                           text=True, timeout=120)
    return "" if probe.returncode == 0 else (probe.stderr.strip() or probe.stdout)[-300:]


def _run(code):
    if _nvvm_missing():
        pytest.skip(f"no NVVM to compile with: {_nvvm_missing()}")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# ---------------------------------------------------------------------------
# signatures (inside the subprocess)
# ---------------------------------------------------------------------------
def _signatures(module):
    """``{kernel name: [argument types, ...]}`` of ``module``'s kernels."""
    from numba import types as T

    f32, f64, i32, i64 = T.float32, T.float64, T.int32, T.int64
    u8, u16, u32, u64, b1 = T.uint8, T.uint16, T.uint32, T.uint64, T.boolean

    def A(t):
        return t[::1]
    IDX = (i32, i64)                    # sparsifier index widths (codecs.sparsifier.index_dtype)
    WORDS = (u32, u64)                  # Strom word widths (word_dtype)

    if module == "cuda_util":
        return {
            # add / subtract (float32); copy: float32 vectors, uint8 packets
            "_binary": [(A(f32), A(f32), A(f32), i64), (A(u8), A(u8), A(u8), i64)],
            # fill: float32 vectors, int64 / int32 counters and flags, uint32
            # column lengths, uint64 keys and bitmaps
            "_fill": [(A(t), t) for t in (f32, i64, i32, u32, u64)],
            "_header": [(A(u8), u8, u8, u64, u64)],
            "_count_nonfinite": [(A(f32), A(i64))],
            "_divide": [(A(f32), f32)],
        }

    # the 14 arguments of a source (cuda_quantize): base, has_base, four
    # packets' views (a, b), npk, flag, e, has_e
    def source(a, b):
        return (A(f32), b1) + (A(a), A(b)) * 4 + (i64, b1, A(f32), b1)
    outputs = (A(f32), b1, A(f32), b1)  # e_out, has_eout, out, has_out
    # each dense codec's packet views (device_codecs/*._views)
    views = {"half": (u16, u16), "onebit": (u32, f32), "tern": (u8, f32), "qsgd": (u8, f32)}

    if module == "cuda_quantize":
        sigs = {
            "_onebit_means_kernel": [(A(f32), i64, A(f32))],
            "_onebit_pack_kernel": [(A(f32), A(u32))],
            "_onebit_unpack_kernel": [(A(u32), A(f32), i64, A(f32), b1)],
            "_tern_pack_kernel": [(A(f32), u64, i64, f32, f32, A(u8))],
            "_qsgd_scales_kernel": [(A(f32), i64, b1, A(f32))],
            "_qsgd_pack_kernel": [(A(f32), A(f32), i64, i64, i64, u64, i64, A(u8))],
            "_codes_decode_kernel": [(A(u8), i64, i64, i64, A(f32), A(f32), b1)],
            "half_code": [source(*views["half"]) + (i64, A(u16)) + outputs + (A(i64), b1)],
            "onebit_columns": [source(*views["onebit"]) + (i64, i64, i64, A(f32), A(u32), b1)
                               + outputs + (A(i64), b1)],
            "onebit_words": [source(*views["onebit"]) + (i64, i64, i64, A(f32), A(u32))
                             + outputs],
            "tern_lanes": [source(*views["tern"]) + (i64, A(f64), A(f32), A(i64))],
            "tern_totals": [(i64, A(f64), A(f32), A(i64), A(f64))],
            "tern_code": [source(*views["tern"]) + (i64, u64, i64, f32, f32, u32, A(u8), A(u32))
                          + outputs],
            "qsgd_buckets": [source(*views["qsgd"]) + (i64, i64, i64, i64, b1, u64, i64, b1, f64,
                                                       f64, A(f32), A(u8), i64, A(f64), A(f64),
                                                       b1) + outputs + (A(i64), b1)],
            "qsgd_bytes": [source(*views["qsgd"]) + (i64, i64, i64, i64, u64, i64, A(u8), i64,
                                                     A(f64), A(f64)) + outputs],
        }
        for codec, (a, b) in views.items():
            sigs[f"{codec}_presum"] = [source(a, b) + (A(f32),)]
            sigs[f"{codec}_decode"] = [(A(a), A(b), b1, A(f32), i64)]
        return sigs

    if module == "cuda_sparsify":
        return {
            # threshold compaction, Strom words and scatters
            "_count_tiles": [(A(f32), f32, A(i64))],
            "_compact_tiles": [(A(f32), f32, A(i64), A(ix), A(f32)) for ix in IDX],
            "_pack_sign_words": [(A(ix), A(f32), A(w)) for ix, w in zip(IDX, WORDS)],
            "_scatter": [(A(f32), A(ix), A(f32), b1) for ix in IDX],
            "_scatter_sign_words": [(A(w), f32, A(f32), b1) for w in WORDS],
            # top-k selection
            "_fill_runs": [(A(f32), f32), (A(i64), i64), (A(i32), i32)],
            "_compensate_runs": [(A(f32), A(f32), b1, A(f32), b1, A(i64))],
            "_gather_strided": [(A(u32), i64, i64, A(u32))],
            "_radix_init": [(A(i64), i64, A(i64))],
            "_radix_hist": [(A(u32), A(i64), i64, i64, A(i64))],
            "_radix_pick": [(A(i64), i64, i64, A(i64))],
            "_count_classes": [(A(f32), A(f32), A(i64))],
            "_compact_classes": [(A(f32), A(ix), b1, A(f32), i64, A(i64), A(i64), A(ix), A(f32))
                                 for ix in IDX],
            "_scatter_runs": [(A(f32), A(ix), A(f32), i64) for ix in IDX],
            "_check_pairs": [(A(u8), A(ix), i64, i64, i64, i64, A(i32), i64) for ix in IDX],
        }

    if module == "cuda_select":
        return {
            "_set2": [(A(i64), i64, i64)],
            "_scan_sums": [(A(i64), A(i64))],
            "_scan_top": [(A(i64), A(i64), i64)],
            "_scan_apply": [(A(i64), A(i64), A(i64))],
            "_ss_lanes": [(A(f32), A(f64))],
            "_ss_tau": [(A(f32), A(f64), f64, A(f32), A(f64))],
            "_count_select": [(A(f32), A(u32), A(f32), A(i64), A(i64), A(i64), A(i64), b1)],
            "_radix_hist": [(A(f32), A(u32), A(f32), A(i64), i64, A(i64))],
            "_radix_pick": [(A(i64), A(i64), i64)],
            "_kept": [(A(i64), A(i64), A(i64), A(i64), A(i64))],
            "_compact_words": [(A(f32), A(u32), A(f32), A(i64), A(i64), A(i64), A(w), A(f32), b1,
                                A(f32), b1) for w in WORDS],
            "_tau_fields": [(A(f32), A(f32), i64)],
            "_check_words": [(A(w), i64, A(f32), A(u32), A(i64), i64) for w in WORDS],
            "_scatter_words": [(A(w), A(f32), A(f32), i64) for w in WORDS],
            "_floyd": [(u64, i64, i64, A(u64))],
            "_bit_counts": [(A(u64), A(i64))],
            "_bit_indices": [(A(u64), A(i64), A(ix)) for ix in IDX],
            "_gather": [(A(f32), A(ix), f32, b1, A(f32), A(f32), b1) for ix in IDX],
            "_scatter_vals": [(A(ix), A(f32), A(f32), i64) for ix in IDX],
            "_read_u64": [(A(u8), i64, A(u64), i64)],
            "_adaptive_stats": [(A(f32), A(u32), i64, i64, i64, i64, u64, u64, A(i64), A(f32),
                                 A(i64), A(i64), b1)],
            "_adaptive_write": [(A(f32), A(u32), i64, A(i64), A(f32), A(i64), A(i64), A(u32),
                                 A(f32), A(u32), A(f32), b1, A(f32), b1)],
            "_adaptive_counts": [(A(u32), A(u32), i64, A(i64))],
            "_adaptive_check": [(A(u32), A(u32), i64, i64, i64, A(i64), A(i64), A(i64),
                                 A(i64), i64)],
            "_adaptive_scatter": [(A(u32), A(f32), i64, i64, A(i64), A(i64), A(f32), i64)],
        }
    raise ValueError(module)


def _device_signatures(module):
    """``{device function: [argument types, ...]}`` compiled on their own:
    cuda_util's, which the other modules' kernels call."""
    from numba import types as T

    if module != "cuda_util":
        return {}
    f32, f64, i64 = T.float32, T.float64, T.int64
    return {"dmul_rn": [(f64, f64)], "fmul_rn": [(f32, f32)],
            "imin": [(i64, i64), (f32, f32)], "imax": [(i64, i64), (f32, f32)]}


def _target():
    """numba.cuda set up to compile for sm_90 without a device (device
    functions compile for "the current device": pretend one)."""
    from numba import config

    assert not config.ENABLE_CUDASIM, "run without NUMBA_ENABLE_CUDASIM"
    import numba.cuda.dispatcher as dispatcher

    class _Device:
        compute_capability = (9, 0)
    dispatcher.get_current_device = lambda: _Device()


def _jitted(mod, device):
    return sorted(name for name in dir(mod)
                  if getattr(getattr(mod, name), "targetoptions", {}).get("device") is device)


def kernels_of(mod):
    """The names of ``mod``'s kernels (``@cuda.jit`` dispatchers that are
    not device functions)."""
    return _jitted(mod, False)


def device_functions_of(mod):
    """The names of ``mod``'s device functions (those it imports from
    cuda_util left out: cuda_util's own check compiles them)."""
    from hpccomm.kernels import cuda_util

    return [name for name in _jitted(mod, True)
            if mod is cuda_util or getattr(cuda_util, name, None) is not getattr(mod, name)]


#: ``mul.f32 d, a, 2**-24`` (the uniform of rng.uniform01), ``cvt.rn.f32.u64 a, r``,
#: ``shr.u64 r, x, s``
_UNIFORM = re.compile(r"^\s*mul\.f32\s+%f\d+,\s*(%f\d+),\s*0f33800000;")
_DEF = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,\s*(.*);")


def _exact_uniform(line, defs):
    """Whether ``line`` is the exact product of :func:`rng.uniform01`: a
    24-bit integer (``shr.u64`` by 40 or more, converted by
    ``cvt.rn.f32.u64``) times ``2**-24`` (see the module docstring)."""
    m = _UNIFORM.match(line)
    if not m or len(defs.get(m.group(1), ())) != 1:
        return False
    op, args = defs[m.group(1)][0]
    if op != "cvt.rn.f32.u64" or len(defs.get(args[0], ())) != 1:
        return False
    op, args = defs[args[0]][0]
    return op == "shr.u64" and len(args) == 2 and args[1].isdigit() and int(args[1]) >= 40


def loose_lines(ptx):
    """The lines of ``ptx`` holding an instruction the kernels must not have."""
    defs = {}
    for line in ptx.splitlines():
        m = _DEF.match(line)
        if m:
            defs.setdefault(m.group(2), []).append(
                (m.group(1), [a.strip() for a in m.group(3).split(",")]))
    return [line.strip() for line in ptx.splitlines()
            if LOOSE.search(line) and not _exact_uniform(line, defs)]


def check_module(module):
    """Compile every kernel of ``hpccomm.kernels.<module>`` for sm_90 with
    each of its signatures and print a summary; fail, listing every problem,
    when a kernel does not compile, holds a loose instruction or has no
    signature here, or a device function was compiled by no kernel."""
    import importlib
    import time

    _target()
    from numba import cuda

    mod = importlib.import_module(f"hpccomm.kernels.{module}")
    sigs = _signatures(module)
    kernels = kernels_of(mod)
    problems = [f"{name}: a kernel without a compile check" for name in kernels
                if name not in sigs]
    problems += [f"{name}: not a kernel of {module}" for name in sigs if name not in kernels]
    own = _device_signatures(module)
    start = time.perf_counter()
    jobs = [(name, sig, False) for name in kernels for sig in sigs.get(name, [])]
    jobs += [(name, sig, True) for name, variants in own.items() for sig in variants]
    for name, sig, device in jobs:
        what = f"{name}({', '.join(map(str, sig))})"
        try:
            ptx, _ = cuda.compile_ptx(getattr(mod, name).py_func, sig, device=device,
                                      cc=(9, 0))
        except Exception as exc:            # typing / lowering errors: report them all
            first = str(exc).strip().splitlines()
            problems.append(f"{what}: does not compile: {type(exc).__name__}: "
                            f"{first[0] if first else ''}")
            continue
        bad = loose_lines(ptx)
        if bad:
            problems.append(f"{what}: {bad[:4]}")
    devices = device_functions_of(mod)
    problems += [f"{name}: a device function no kernel compiled" for name in devices
                 if name not in own and not getattr(mod, name).overloads]
    print(f"{module}: {len(kernels)} kernels, {len(jobs)} signatures, "
          f"{len(devices)} device functions, {time.perf_counter() - start:.1f} s")
    assert not problems, "\n".join(problems)


def check_detector():
    """The PTX check itself: a product feeding an addition without
    ``fmul_rn`` is caught (NVVM contracts it into ``fma.rn.f32``), the same
    through ``cuda_util.fmul_rn`` passes; the builtin two-argument ``min``
    does not compile (numba/numba#10753), ``cuda_util.imin`` does."""
    _target()
    from numba import cuda
    from numba import types as T

    from hpccomm.kernels.cuda_util import fmul_rn, imin

    def fused(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = x[i] * x[i] + y[i]

    def unfused(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = fmul_rn(x[i], x[i]) + y[i]

    def builtin_min(x, y):
        i = cuda.grid(1)
        y[min(i, x.size - 1)] = 0

    def own_min(x, y):
        i = cuda.grid(1)
        y[imin(i, x.size - 1)] = 0

    sig = (T.float32[::1], T.float32[::1])
    ptx, _ = cuda.compile_ptx(fused, sig, cc=(9, 0))
    assert loose_lines(ptx), "a fused multiply-add went unnoticed"
    ptx, _ = cuda.compile_ptx(unfused, sig, cc=(9, 0))
    assert not loose_lines(ptx), loose_lines(ptx)
    assert "mul.rn.f32" in ptx
    cuda.compile_ptx(own_min, sig, cc=(9, 0))
    try:
        cuda.compile_ptx(builtin_min, sig, cc=(9, 0))
    except Exception:
        pass
    else:   # pragma: no cover - a numba that types min(a, b) for CUDA again
        print("note: the builtin min compiles for CUDA with this numba")


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", MODULES)
def test_kernels_compile_for_sm90(module):
    print(_run(f"from tests.test_cuda_compile import check_module; check_module({module!r})"))


def test_ptx_check_catches_fused_products():
    print(_run("from tests.test_cuda_compile import check_detector; check_detector()"))
