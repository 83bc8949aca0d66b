"""GPU kernels (:mod:`hpccomm.kernels.cuda_quantize`, the threshold / scatter
part of :mod:`hpccomm.kernels.cuda_sparsify`) against the CPU kernels and
codecs, on numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is imported, so each check
below runs in a process of its own with ``NUMBA_ENABLE_CUDASIM=1``; a plain
``pytest tests`` runs them (and skips them when numba-cuda is missing).  The
simulator runs each thread's code in Python, about 200 ms per 10k elements:
inputs stay small.  The checks demand the very bytes of the CPU packets.
"""
import functools
import warnings

import numpy as np
import pytest

from .cudasim import run_check

SIZES = [0, 1, 7, 33, 203]


_run = functools.partial(run_check, "test_cuda_sim")


def _setup():
    from numba import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    # the simulator runs the uint64 hash on numpy scalars, which warn on wraparound
    warnings.simplefilter("ignore", RuntimeWarning)
    from hpccomm.kernels import cuda_quantize as gpu

    return gpu


def _data(n, seed):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if n > 6:
        x[5], x[6] = 0.0, -0.0
    return x


# ---------------------------------------------------------------------------
# checks (run inside the simulator subprocess)
# ---------------------------------------------------------------------------
def check_onebit():
    gpu = _setup()
    import hpccomm

    for n in SIZES:
        x = _data(n, n)
        for col_len in (1, 5, 32, 37, 1000):
            codec = hpccomm.get_codec("onebit", col_len=col_len)
            packet = codec.encode(x)
            H = min(col_len, max(n, 1))
            C = -(-n // H)
            means = gpu.onebit_means(x, H).copy_to_host()
            words = gpu.onebit_pack(x).copy_to_host()
            assert np.array_equal(means.view(np.uint8), packet[16:16 + 8 * C]), (n, col_len)
            assert np.array_equal(words.view(np.uint8), packet[16 + 8 * C:]), (n, col_len)
            expect = codec.decode(packet, np.empty(n, np.float32))
            assert np.array_equal(gpu.onebit_unpack(words, means, H, n).copy_to_host(), expect)
            base = np.arange(n, dtype=np.float32)
            added = gpu.onebit_unpack(words, means, H, n, out=base, add=True).copy_to_host()
            assert np.array_equal(added, base + expect)


def check_terngrad():
    gpu = _setup()
    import hpccomm
    from hpccomm.codecs.base import EncodeContext

    for clip in (2.5, None):
        codec = hpccomm.get_codec("terngrad", clip=clip)
        for n in SIZES:
            x = _data(n, 100 + n)
            ctx = EncodeContext(seed=5, rank=2, step=9, offset=13)
            packet = codec.encode(x, ctx)
            s = codec.scale(x)
            key = codec._key(ctx)
            packed = gpu.tern_pack(x, key, ctx.offset, s, s).copy_to_host()
            assert np.array_equal(packed, packet[20:]), (clip, n)
            decoded = gpu.codes_decode(packed, 2, max(n, 1), 1, np.array([s], np.float32), n)
            assert np.array_equal(decoded.copy_to_host(),
                                  codec.decode(packet, np.empty(n, np.float32)))


def check_qsgd():
    gpu = _setup()
    import hpccomm
    from hpccomm.codecs.base import EncodeContext

    for bits in (2, 4, 8):
        for bucket, norm in ((7, "l2"), (64, "max"), (512, "l2")):
            codec = hpccomm.get_codec("qsgd", bits=bits, bucket=bucket, norm=norm)
            for n in SIZES:
                x = _data(n, 200 + n)
                ctx = EncodeContext(seed=6, rank=1, step=3, offset=21)
                packet = codec.encode(x, ctx)
                d = min(bucket, max(n, 1))
                nb = -(-n // d)
                scales = gpu.qsgd_scales(x, d, norm == "max").copy_to_host()
                assert np.array_equal(scales.view(np.uint8), packet[16:16 + 4 * nb])
                packed = gpu.qsgd_pack(x, scales, d, bits, codec._key(ctx), ctx.offset)
                assert np.array_equal(packed.copy_to_host(), packet[16 + 4 * nb:]), (bits, n)
                decoded = gpu.codes_decode(packed, bits, d, codec.levels, scales, n)
                assert np.array_equal(decoded.copy_to_host(),
                                      codec.decode(packet, np.empty(n, np.float32)))


def check_device_arrays_in_and_out():
    gpu = _setup()
    from numba import cuda

    x = cuda.to_device(_data(100, 7))
    words = gpu.onebit_pack(x)
    means = gpu.onebit_means(x, 10)
    out = cuda.device_array(100, dtype=np.float32)
    assert gpu.onebit_unpack(words, means, 10, 100, out=out) is out
    host = out.copy_to_host()
    assert np.all((host >= 0) == (x.copy_to_host() >= 0))


def check_sparsify():
    """:mod:`hpccomm.kernels.cuda_sparsify`'s threshold compaction, Strom words
    and scatters against :mod:`hpccomm.kernels.sparsify`, on the default
    stream and on another one (the launches and copies follow
    ``cuda_util.current_stream``)."""
    _setup()
    from numba import cuda

    from hpccomm.kernels import cuda_sparsify as gpu
    from hpccomm.kernels import cuda_util as U
    from hpccomm.kernels import sparsify as cpu

    other = cuda.stream()
    for n in SIZES + [3 * gpu.TILE + 5]:
        x = np.round(_data(n, 300 + n), 1)         # ties at the thresholds
        # the multi-tile size once (the simulator runs a thread per element)
        for t in (0.0, 0.5, np.inf) if n < gpu.TILE else (0.5,):
            idt, wdt = (np.int32, np.uint32) if t else (np.int64, np.uint64)
            with U.on_stream(other if n % 2 else None):
                idx, vals = cpu.select_abs_ge(x, t, idt)
                d_idx, d_vals = gpu.select_abs_ge(x, t, idt)
                got_idx, got_vals = U.to_host(d_idx), U.to_host(d_vals)
                assert got_idx.dtype == idt and np.array_equal(got_idx, idx), (n, t)
                assert np.array_equal(got_vals.view(np.uint32), vals.view(np.uint32))
                words = np.empty(idx.size, wdt)
                cpu.pack_sign_words(idx, vals, words)
                got = U.to_host(gpu.pack_sign_words(d_idx, d_vals, wdt))
                assert got.dtype == wdt and np.array_equal(got, words), (n, t)
                for add in (False, True):
                    base = _data(n, 400 + n)
                    want = base.copy()
                    cpu.scatter(want, idx, vals, add)
                    out = U.to_device(base)
                    assert gpu.scatter(out, idx, vals, add) is out
                    assert np.array_equal(U.to_host(out), want), (n, t, add)
                    want = base.copy()
                    cpu.scatter_sign_words(words, np.float32(0.75), want, add)
                    out = U.to_device(base)
                    gpu.scatter_sign_words(words, 0.75, out, add)
                    assert np.array_equal(U.to_host(out), want), (n, t, add)


# ---------------------------------------------------------------------------
# tests (run the checks)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", ["check_onebit", "check_terngrad", "check_qsgd",
                                   "check_device_arrays_in_and_out", "check_sparsify"])
def test_gpu_kernels_match_cpu_bytes(check):
    _run(check)
