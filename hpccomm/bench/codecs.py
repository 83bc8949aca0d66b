"""``python -m hpccomm.bench codecs``: encode / decode throughput of every codec.

One process, no MPI traffic.  For each codec and size: the median over
repetitions of ``encode(x)`` and ``decode(packet, out)`` on Gaussian float32
input, reported as GB/s of float32 input (``4 n / time``); bits per element on
the wire (``8 * packet bytes / n``, headers included); the relative L2 error
of one round trip; and, measured in the same run, the machine's memcpy
bandwidth (``numpy.copyto`` of the same float32 array, GB/s of the input
side) so that each kernel can be read as a fraction of the memory ceiling:
``(enc+dec)/memcpy`` is the throughput of encode followed by decode divided by
memcpy's.

Error feedback: ``ef GB/s`` is the encode with error feedback -- ``v = x + e``,
the packet of ``v``, ``e' = v - decode(packet)`` -- through the codec's fused
``encode_with_feedback`` where it has one (``fused``), else the three steps;
``ef/floor`` is the bytes that encode must move (read ``x`` and ``e``, write
``e'`` and the packet: ``12 n`` + packet) over its time, as a fraction of the
bytes memcpy moves per second (read + write).  The fused kernels are also
timed against the three steps they replace (``3-step GB/s``).

``powersgd`` has no packets (its algorithm reduces the factors): its row
times one rank's local work of a call on the size as a matrix of about
``sqrt(n)`` rows -- ``enc``: ``P = M Q``, Gram-Schmidt, ``Q_w = M^T P``;
``dec``: ``P Q^T`` and ``P Q_w^T`` together; ``ef``: both and the residual
``v - P Q_w^T`` (seven float32 passes: ``ef/floor`` counts ``28 n`` bytes);
bits per element ``32 r (rows + cols) / n``; ``rel_l2`` the error of one
power step from random ``Q`` (Gaussian matrices have no low-rank structure:
it shows the step works, not what gradients lose).

``--device cuda``: the codecs' device twins (:mod:`hpccomm.device_codecs`) on
a GPU, timed with CUDA events on one stream: ``ef`` is the twin's
``encode_with_feedback`` (input and residual already on the device), ``dec``
its decode, and ``memcpy`` a device-to-device copy of the same array measured
in the same run; ``(ef+dec)/memcpy`` reads as above.  Only codecs with a twin
run.  Under ``NUMBA_ENABLE_CUDASIM=1`` it runs on the simulator (a functional
check: the times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ..options import resolve_options
from .harness import parse_options, parse_size

DEFAULT_OPTIONS = {
    "threshold": {"alpha": 2.5},
}


def _median_time(fn, reps: int) -> float:
    fn()  # warm (JIT compile, page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def memcpy_bandwidth(x: np.ndarray, reps: int) -> float:
    dst = np.empty_like(x)
    t = _median_time(lambda: np.copyto(dst, x), reps)
    return x.nbytes / t / 1e9


def measure(codec, x: np.ndarray, reps: int) -> dict:
    from ..codecs.base import EncodeContext

    ctx = EncodeContext(seed=1, rank=0, step=0, offset=0, shape=(x.size,))
    packet = codec.encode(x, ctx)
    out = np.empty_like(x)
    t_enc = _median_time(lambda: codec.encode(x, ctx), reps)
    t_dec = _median_time(lambda: codec.decode(packet, out), reps)
    codec.decode(packet, out)
    diff = out.astype(np.float64) - x
    norm = float(np.linalg.norm(x))
    e = np.random.default_rng(7).standard_normal(x.size).astype(np.float32) * np.float32(0.1)
    e_out, v, dec = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def three_steps():
        np.add(x, e, out=v)
        codec.decode(codec.encode(v, ctx), dec)
        np.subtract(v, dec, out=e_out)

    t_three = _median_time(three_steps, reps)
    fused = getattr(codec, "encode_with_feedback", None)
    t_ef = _median_time(lambda: fused(x, e, e_out, ctx), reps) if fused else t_three
    return {
        "ef_fused": fused is not None, "ef_s": t_ef, "ef_gbs": x.nbytes / t_ef / 1e9,
        "three_step_gbs": x.nbytes / t_three / 1e9,
        "ef_bytes_moved": 3 * x.nbytes + packet.size,
        "encode_s": t_enc, "decode_s": t_dec,
        "encode_gbs": x.nbytes / t_enc / 1e9, "decode_gbs": x.nbytes / t_dec / 1e9,
        "roundtrip_gbs": x.nbytes / (t_enc + t_dec) / 1e9,
        "bits_per_element": 8.0 * packet.size / x.size,
        "rel_l2": float(np.linalg.norm(diff)) / norm if norm else 0.0,
    }


def measure_lowrank(codec, x: np.ndarray, reps: int) -> dict:
    """The row of a codec without packets (``powersgd``): see the module docstring."""
    from ..kernels import lowrank as K
    from ..kernels.rng import stream_key

    rows = 1 << (max(x.size, 1).bit_length() - 1) // 2
    cols = x.size // rows
    M = x[:rows * cols].reshape(rows, cols)
    r = min(codec.rank, rows, cols)
    Q = np.empty((cols, r), np.float32)
    K.fill_uniform(stream_key(1, 0, 0, codec.codec_id), Q)
    K.orthogonalize(Q, 0.0)
    P, Qw = np.empty((rows, r), np.float32), np.empty((cols, r), np.float32)
    out, share, e = (np.empty_like(M) for _ in range(3))

    def compress():
        K.project(M, Q, P)
        K.orthogonalize(P, codec.orthogonalization_epsilon)
        K.back_project(M, P, Qw)

    def decompress():
        K.expand_pair(P, Qw, Qw, out, share)

    def local():
        compress()
        decompress()
        np.subtract(M, share, out=e)

    t_enc = _median_time(compress, reps)
    t_dec = _median_time(decompress, reps)
    t_ef = _median_time(local, reps)
    nbytes = M.nbytes
    norm = float(np.linalg.norm(M))
    return {
        "ef_fused": False, "ef_s": t_ef, "ef_gbs": nbytes / t_ef / 1e9,
        "three_step_gbs": nbytes / t_ef / 1e9, "ef_bytes_moved": 7 * nbytes,
        "encode_s": t_enc, "decode_s": t_dec,
        "encode_gbs": nbytes / t_enc / 1e9, "decode_gbs": nbytes / t_dec / 1e9,
        "roundtrip_gbs": nbytes / (t_enc + t_dec) / 1e9,
        "bits_per_element": 32.0 * r * (rows + cols) / M.size,
        "rel_l2": float(np.linalg.norm(out.astype(np.float64) - M)) / norm if norm else 0.0,
        "matrix": [rows, cols],
    }


def _device_timer(reps: int):
    """``time(fn)``: the median seconds of ``fn`` on the device (CUDA events on
    the default stream; wall clock after a synchronize under the simulator)."""
    from numba import config, cuda

    def timed(fn) -> float:
        fn()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            if config.ENABLE_CUDASIM:
                t0 = time.perf_counter()
                fn()
                cuda.synchronize()
                times.append(time.perf_counter() - t0)
                continue
            start, stop = cuda.event(timing=True), cuda.event(timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cuda.event_elapsed_time(start, stop) / 1e3)
        return float(np.median(times))

    return timed


def measure_device(codec, x: np.ndarray, reps: int) -> dict:
    """The ``--device cuda`` row of ``codec`` on ``x`` (see the module docstring)."""
    from ..codecs.base import EncodeContext
    from ..device_codecs import device_codec_for
    from ..kernels import cuda_util as U

    twin = device_codec_for(codec)
    timed = _device_timer(reps)
    ctx = EncodeContext(seed=1, rank=0, step=0, offset=0, shape=(x.size,), feedback=True)
    xd = U.to_device(x)
    e = U.to_device(np.random.default_rng(7).standard_normal(x.size).astype(np.float32)
                    * np.float32(0.1))
    e_out, out, dst = (U.empty(x.size, np.float32) for _ in range(3))
    packet = twin.encode_with_feedback(xd, e, e_out, ctx)
    t_mem = timed(lambda: dst.copy_to_device(xd))
    t_ef = timed(lambda: twin.encode_with_feedback(xd, e, e_out, ctx))
    t_dec = timed(lambda: twin.decode(packet, out))
    # the packet of the same input and context from the host codec, byte for byte
    host_e = U.to_host(e)
    host = codec.encode_with_feedback(x, host_e, np.empty_like(x), ctx) \
        if getattr(codec, "encode_with_feedback", None) else None
    same = None if host is None else bool(np.array_equal(U.to_host(packet), host))
    mem = x.nbytes / t_mem / 1e9
    return {"device": "cuda", "memcpy_gbs": mem, "ef_s": t_ef, "decode_s": t_dec,
            "ef_gbs": x.nbytes / t_ef / 1e9, "decode_gbs": x.nbytes / t_dec / 1e9,
            "roundtrip_gbs": x.nbytes / (t_ef + t_dec) / 1e9,
            "fraction_of_memcpy": x.nbytes / (t_ef + t_dec) / 1e9 / mem,
            "bits_per_element": 8.0 * packet.size / max(x.size, 1),
            "same_packet_as_host": same}


def main_device(names, per_codec, sizes, reps, json_path) -> int:
    """``--device cuda``: one row per codec with a device twin and size."""
    import hpccomm
    from numba import config, cuda

    from ..device_codecs import device_codec_class, device_codec_for

    if not config.ENABLE_CUDASIM and not cuda.is_available():
        raise SystemExit("--device cuda: numba.cuda finds no GPU (NUMBA_ENABLE_CUDASIM=1 runs "
                         "the simulator)")
    where = "simulator" if config.ENABLE_CUDASIM else cuda.get_current_device().name
    where = where.decode() if isinstance(where, bytes) else where
    print(f"# hpccomm codec benchmark on the device ({where}): GB/s of float32 input, "
          f"median of {reps} (CUDA events)")
    print(f"#{'codec':>23} {'n':>10} {'bits/elem':>10} {'ef GB/s':>9} {'dec GB/s':>9} "
          f"{'memcpy':>8} {'(ef+dec)/memcpy':>16} {'=host':>6}")
    rows = []
    for n in sizes:
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        for name in names:
            codec = None if device_codec_class(name) is None else \
                hpccomm.get_codec(name, **per_codec.get(name, {}))
            if codec is None or device_codec_for(codec) is None:   # e.g. rotate=True
                print(f"{name:>24} {n:>10}  (no device twin)")
                continue
            r = measure_device(codec, x, reps)
            r.update(codec=codec.describe(), n=n, gpu=where)
            rows.append(r)
            print(f"{codec.describe():>24} {n:>10} {r['bits_per_element']:>10.3f} "
                  f"{r['ef_gbs']:>9.2f} {r['decode_gbs']:>9.2f} {r['memcpy_gbs']:>8.2f} "
                  f"{r['fraction_of_memcpy']:>16.1%} {str(r['same_packet_as_host']):>6}",
                  flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"device": where, "rows": rows}, f, indent=1)
    return 0


def main(argv=None) -> int:
    import numba

    import hpccomm

    p = argparse.ArgumentParser(prog="python -m hpccomm.bench codecs",
                                description="Encode/decode throughput of hpccomm's codecs "
                                            "against the machine's memcpy bandwidth.")
    p.add_argument("--codec", default=None,
                   help="comma-separated codecs (default: all registered)")
    p.add_argument("--sizes", default="1M,64M",
                   help="element counts (K/M = 2^10/2^20 elements; default 1M,64M)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--threads", type=int, default=1, help="numba threads (default 1)")
    p.add_argument("--option", action="append", default=[], metavar="CODEC.KEY=VALUE",
                   help="codec option, e.g. --option topk.ratio=0.001 (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the numba CPU kernels (default); cuda: the device twins on a GPU")
    p.add_argument("-J", "--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    numba.set_num_threads(max(1, min(args.threads, numba.config.NUMBA_NUM_THREADS)))
    from hpccomm.kernels import threads as kernel_threads
    kernel_threads.set_threads(numba.get_num_threads())
    names = [c.strip() for c in args.codec.split(",")] if args.codec else list(
        hpccomm.available_codecs())
    options = parse_options(args.option)
    for k in options:
        if "." not in k:
            raise SystemExit(f"--option takes CODEC.KEY=VALUE, not {k!r}")
    per_codec = {}
    for name in names:
        taken, _ = resolve_options(name, None, options, strict=False)
        per_codec[name] = {**DEFAULT_OPTIONS.get(name, {}), **taken}
    unused = [k for k in options
              if not any(resolve_options(c, None, {k: None}, strict=False)[0] for c in names)]
    if unused:
        raise SystemExit(f"option(s) {', '.join(unused)} taken by none of the codecs")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.device == "cuda":
        return main_device(names, per_codec, sizes, args.reps, args.json)
    rows = []
    print("# hpccomm codec benchmark: GB/s of float32 input, median of "
          f"{args.reps}; numba threads: {numba.get_num_threads()}")
    print(f"#{'codec':>23} {'n':>10} {'bits/elem':>10} {'enc GB/s':>9} {'dec GB/s':>9} "
          f"{'memcpy':>8} {'(enc+dec)/memcpy':>17} {'rel_l2':>9} {'ef':>6} {'ef GB/s':>8} "
          f"{'3-step GB/s':>11} {'ef/floor':>8}")
    for n in sizes:
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        mem = memcpy_bandwidth(x, args.reps)
        print(f"# memcpy {n} float32: {mem:.2f} GB/s", flush=True)
        for name in names:
            codec = hpccomm.get_codec(name, **per_codec.get(name, {}))
            r = (measure_lowrank if codec.algorithm else measure)(codec, x, args.reps)
            r.update(codec=codec.describe(), n=n, memcpy_gbs=mem,
                     fraction_of_memcpy=r["roundtrip_gbs"] / mem,
                     ef_fraction_of_floor=r["ef_bytes_moved"] / r["ef_s"] / 1e9 / (2 * mem))
            rows.append(r)
            print(f"{codec.describe():>24} {n:>10} {r['bits_per_element']:>10.3f} "
                  f"{r['encode_gbs']:>9.2f} {r['decode_gbs']:>9.2f} {mem:>8.2f} "
                  f"{r['fraction_of_memcpy']:>17.1%} {r['rel_l2']:>9.2e} "
                  f"{'fused' if r['ef_fused'] else 'local' if codec.algorithm else '3-step':>6} "
                  f"{r['ef_gbs']:>8.2f} "
                  f"{r['three_step_gbs']:>11.2f} {r['ef_fraction_of_floor']:>8.1%}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": numba.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
