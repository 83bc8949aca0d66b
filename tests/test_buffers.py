"""Buffers, dtype conversions, validation helpers and bench argument parsing
(no MPI communication)."""
import argparse

import numpy as np
import pytest

from hpccomm.bench.harness import parse_range, parse_size, sizes_from
from hpccomm.buffers import (as_buffer, bf16_bits_to_f32, f32_to_bf16_bits, mpi_cuda_support_reason,
                             resolve_gpu_aware)
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend
from hpccomm.validation import _ranges, description_hash, explain_mismatch



@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 4), (2, 3, 5)])
def test_numpy_buffers_are_flat_views(shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    buf = as_buffer(x)
    assert buf.kind == "numpy" and buf.shape == shape and buf.dtype == "float32"
    assert buf.size == x.size and not buf.on_device
    assert np.shares_memory(buf.host, x) or x.size == 0
    assert buf.wrap(buf.host.copy()).shape == shape


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.complex64, bool])
def test_unsupported_dtypes(dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        as_buffer(np.zeros(4, dtype=dtype))


def test_non_contiguous_is_refused():
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_buffer(np.zeros((4, 4), np.float32)[:, 0])
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_buffer(np.zeros((4, 4), np.float32).T)


def test_other_objects_are_refused():
    with pytest.raises(TypeError, match="cannot reduce a list"):
        as_buffer([1.0, 2.0])


def test_cuda_array_interface_needs_a_backend():
    with pytest.raises(TypeError, match="no device backend"):
        as_buffer(HostDeviceArray(np.zeros(3, np.float32)))


def test_cuda_array_interface_strides_checked():
    import hpccomm

    backend = HostDeviceBackend()
    hpccomm.register_device_backend(backend)
    try:
        good = as_buffer(HostDeviceArray(np.zeros((2, 3), np.float32)))
        assert good.on_device and good.shape == (2, 3) and good.size == 6

        class Strided(HostDeviceArray):
            @property
            def __cuda_array_interface__(self):
                d = dict(super().__cuda_array_interface__)
                d["strides"] = (4, 8)
                return d

        with pytest.raises(ValueError, match="not C-contiguous"):
            as_buffer(Strided(np.zeros((2, 3), np.float32)))
    finally:
        hpccomm.unregister_device_backend(backend)


def test_bf16_widening_is_exact_for_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = bf16_bits_to_f32(bits)
    assert np.array_equal(wide.view(np.uint32) >> 16, bits.astype(np.uint32))


def test_bf16_rounding_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(100000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100000),
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 1.0 + 2.0 ** -8],
                 dtype=np.float32),
    ]).astype(np.float32)
    ours = f32_to_bf16_bits(x)
    ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ours, ref)
    nan = f32_to_bf16_bits(np.array([np.nan], np.float32))
    assert np.isnan(bf16_bits_to_f32(nan)[0])


def test_gpu_aware_resolution(monkeypatch):
    assert resolve_gpu_aware("on") is True and resolve_gpu_aware(False) is False
    monkeypatch.setenv("HPCCOMM_GPU_AWARE", "1")
    assert resolve_gpu_aware("auto") is True
    monkeypatch.setenv("HPCCOMM_GPU_AWARE", "0")
    assert resolve_gpu_aware("auto") is False
    assert mpi_cuda_support_reason() == (False, "HPCCOMM_GPU_AWARE=0, the library not asked")
    monkeypatch.delenv("HPCCOMM_GPU_AWARE")
    assert resolve_gpu_aware("auto") is False  # the MPICH wheel is not CUDA-aware
    answer, reason = mpi_cuda_support_reason()   # asked of the libmpi loaded, which it names
    assert answer is False and " = 0 in /" in reason and "libmpi" in reason, reason
    with pytest.raises(ValueError):
        resolve_gpu_aware("sometimes")


def test_the_library_is_asked_once_per_process(monkeypatch):
    """Finding libmpi reads ``/proc/self/maps`` (milliseconds with torch
    loaded), so the library's answer is kept: asked again, nothing is
    scanned, and the environment still overrides it."""
    from hpccomm.buffers import gpu_aware
    first = mpi_cuda_support_reason()

    def no_scan():
        raise AssertionError("the loaded libraries were scanned again")
    monkeypatch.setattr(gpu_aware, "_libmpi_handles", no_scan)
    assert mpi_cuda_support_reason() == first
    monkeypatch.setenv("HPCCOMM_GPU_AWARE", "1")
    assert mpi_cuda_support_reason() == (True, "HPCCOMM_GPU_AWARE=1, the library not asked")


def test_description_hash_is_stable():
    assert description_hash("n=4 dtype=float32") == description_hash("n=4 dtype=float32")
    assert description_hash("n=4") != description_hash("n=5")
    assert 0 <= description_hash("x") < 2 ** 62


def test_mismatch_explanation_names_the_differences():
    msg = explain_mismatch(["n=4 dtype=float32 op=sum", "n=4 dtype=float32 op=sum",
                            "n=5 dtype=float32 op=sum"])
    assert "ranks 0-1: n=4" in msg and "rank 2: n=5" in msg and "all: dtype=float32 op=sum" in msg
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_bench_sizes():
    assert parse_size("4K") == 4096 and parse_size("64MiB") == 64 << 20
    assert parse_size("1g") == 1 << 30 and parse_size("100") == 100
    assert parse_range("4K:1M") == (4096, 1 << 20)
    assert parse_range("1M") == (4, 1 << 20)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range("1M:4K")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
    assert sizes_from(4096, 1 << 20, 4) == [4096, 16384, 65536, 262144, 1048576]
    assert sizes_from(4, 10, 2) == [4, 8]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000])
def test_count_nonfinite_matches_numpy(dtype, n):
    from hpccomm.kernels.nonfinite import count_nonfinite

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    if n:
        x[rng.integers(0, n, size=max(1, n // 5))] = rng.choice([np.nan, np.inf, -np.inf])
        x[0] = -0.0
    assert count_nonfinite(x) == int(np.count_nonzero(~np.isfinite(x)))
    assert count_nonfinite(x.reshape(-1, 1)) == count_nonfinite(x)
    # NaN payloads and exponent-only patterns, and strided views (1-D float32
    # takes its own kernel)
    bits = x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])
    if n > 3:
        bits[1] |= bits.dtype.type(1) << bits.dtype.type(8 * x.itemsize - 2)   # exponent's top bit
        bits[2] = ~bits.dtype.type(0)                                         # a NaN with every bit
    for view in (x, x[::2], x[1::3], x[::-1]):
        assert count_nonfinite(view) == int(np.count_nonzero(~np.isfinite(view)))


def test_bf16_rounding_matches_a_plain_numpy_reference_on_every_kind_of_bits():
    """One bf16 kernel serves the buffers (IEEE: overflow to inf) and the codec
    (saturating); the buffers' side against numpy, on random bit patterns."""
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2 ** 32, size=100_003, dtype=np.uint64).astype(np.uint32)
    special = np.array([3.4e38, -3.4e38, 3.3961e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45],
                       np.float32)
    for x in (u.view(np.float32), special):
        w = x.view(np.uint32)
        want = ((w + (np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))))
                >> np.uint32(16))
        nan = (w & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        want = np.where(nan, (w >> np.uint32(16)) | np.uint32(0x40), want).astype(np.uint16)
        assert np.array_equal(f32_to_bf16_bits(x), want)
        widened = bf16_bits_to_f32(want)
        assert np.array_equal(widened.view(np.uint32), want.astype(np.uint32) << np.uint32(16))
