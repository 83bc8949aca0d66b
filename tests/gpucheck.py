"""The end-to-end GPU check behind ``./dev.sh gpu``: one command that says
whether hpccomm works on a GPU machine, and how fast, in one report.

    python tests/gpucheck.py [--simulate] [--out bench-out] [--budget 360]

Run by ``./dev.sh gpu`` inside the venv it builds (MPICH, mpi4py and
pytest-mpi over an interpreter that holds numba-cuda, CuPy and torch), from
the repository root.  The steps, each under its own time limit and all
under ``--budget`` seconds:

1. ``info``: the GPU, the driver, the packages, the MPI library and
   whether it is CUDA-aware;
2. the ``gpu`` tests at 1 rank (``tests/test_gpu.py`` and
   ``tests/test_gpu_mpi.py``), then ``tests/test_gpu_mpi.py`` at 2 and 5
   ranks sharing the GPU;
3. ``bench codecs --device cuda`` over every codec with a device twin;
4. ``bench allreduce`` with CuPy and with torch CUDA buffers at 1 and 2
   ranks, MPI_Allreduce in the same run.

``--simulate`` runs the same steps on numba's CUDA simulator at tiny sizes
(host memory presented as device memory: ``--buffer sim``; beyond one rank
the tests of three twins) so that CI keeps the check itself from rotting; its
times are the simulator's and mean nothing.  Writes ``OUT/gpu-report.txt`` (what ran, how long, the tests'
summaries, the benchmarks' tables) and ``OUT/gpu-report.json`` (the same,
with the benchmarks' JSON rows); each step's full output goes to
``OUT/gpu-<step>.log``.  Exits 1 when any step failed or did not run.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

from run import share_bytecode  # tests/run.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INFO = r"""
import importlib, json, platform, subprocess
info = {"python": platform.python_version(), "host": platform.node()}
for name in ("numpy", "numba", "numba_cuda", "cupy", "torch", "mpi4py", "pytest", "pytest_mpi"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:
        info[name] = f"missing ({type(exc).__name__}: {exc})"
from mpi4py import MPI
info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
from hpccomm.buffers import mpi_cuda_support
info["mpi_cuda_aware"] = mpi_cuda_support()
from numba import config, cuda
if config.ENABLE_CUDASIM:
    info["device"] = "numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
else:
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    info["device"] = f"{name}, compute capability {dev.compute_capability}"
    try:
        info["nvidia-smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except OSError as exc:
        info["nvidia-smi"] = f"not run: {exc}"
print(json.dumps(info))
"""


def steps(simulate: bool, out: str, python: str, mpiexec: str):
    """``(name, command, seconds)`` of every step (see the module docstring)."""
    sim = [python, os.path.join("tests", "cudasim.py")] if simulate else [python]
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", "-rfEs",
              "--with-mpi"]
    codec_sizes, reps = ("1K", "2") if simulate else ("64M", "5")
    sizes = ["-m", "4K:4K", "-i", "3", "-x", "1"] if simulate else \
        ["-m", "1M:64M", "-f", "64", "-i", "10", "-x", "2"]
    codecs = "none,onebit,topk" if simulate else "none,bf16,onebit,qsgd,terngrad,topk"
    # the simulator runs each CUDA thread's code in Python: beyond one rank, three twins
    some = ["-k", "onebit or topk or qsgd"] if simulate else []
    buffers = [("sim", "cpu")] if simulate else [("cupy", "cuda"), ("torch", "cuda")]
    plan = [("info", [python, "-c", INFO], 60),
            ("tests-n1", [mpiexec, "-n", "1", *pytest, "-m", "gpu", "tests/test_gpu.py",
                          "tests/test_gpu_mpi.py"], 150),
            ("tests-n2", [mpiexec, "-n", "2", *pytest, "-m", "gpu and mpi", *some,
                          "tests/test_gpu_mpi.py"], 70),
            ("tests-n5", [mpiexec, "-n", "5", *pytest, "-m", "gpu and mpi", *some,
                          "tests/test_gpu_mpi.py"], 90),
            ("codecs", [*sim, "-m", "hpccomm.bench", "codecs", "--device", "cuda", "--sizes",
                        codec_sizes, "--reps", reps, "--json", os.path.join(out, "gpu-codecs.json")],
             60)]
    for buffer, device in buffers:
        for ranks in (1, 2):
            name = f"allreduce-{buffer}-p{ranks}"
            plan.append((name, [mpiexec, "-n", str(ranks), *sim[:1], "-m", "mpi4py", *sim[1:],
                                "-m", "hpccomm.bench", "allreduce", "--buffer", buffer,
                                "--device", device, *sizes,
                                "--codec", codecs, "--algorithm", "twoshot", "--no-progress",
                                "--json", os.path.join(out, f"gpu-{name}.json")], 45))
    return plan


def run(name, cmd, seconds, out, env):
    """Run one step; ``(rc, wall seconds, log path)`` (rc 124: out of time)."""
    log = os.path.join(out, f"gpu-{name}.log")
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    return rc, time.perf_counter() - t0, log


def summary(name, log) -> list:
    """The lines of a step's log that say what it found."""
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    if name == "info":
        return lines[-1:]
    if name.startswith("tests"):
        keep = [line for line in lines if re.match(r"(FAILED|ERROR|SKIPPED) ", line)]
        done = [line for line in lines if re.search(r"\d+ (passed|failed|skipped|error)", line)]
        return keep[:40] + done[-1:]
    # the benchmark's table: its header and its rows (four numbers or more)
    return [line for line in lines[1:] if line.startswith("#") or "no device twin" in line
            or sum(bool(re.fullmatch(r"[-+.\deE%]+", t)) for t in line.split()) >= 4]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true",
                    help="numba's CUDA simulator at tiny sizes (no GPU; for CI)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out"), help="report folder")
    ap.add_argument("--budget", type=float, default=360.0,
                    help="seconds for the whole check (default 360)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    python = sys.executable
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", "1"),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    share_bytecode(env)
    if args.simulate:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
        env["PYTHONWARNINGS"] = "ignore::RuntimeWarning"   # the simulator's uint64 hash wraps
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        env["HPCCOMM_GPU_CHECK"] = "1"      # tests/gpu.py: numba.cuda looks for the GPU
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    results = []
    for name, cmd, seconds in steps(args.simulate, args.out, python, mpiexec):
        left = deadline - time.perf_counter()
        if left < 5:
            results.append({"step": name, "command": " ".join(cmd)[:200], "rc": None,
                            "seconds": 0.0,
                            "summary": ["not run: the check's time budget is spent"]})
            continue
        rc, wall, log = run(name, cmd, min(seconds, left), args.out, env)
        shown = " ".join(cmd) if name != "info" else f"{python} -c <tests/gpucheck.py: INFO>"
        results.append({"step": name, "command": shown, "rc": rc,
                        "seconds": round(wall, 1), "log": os.path.relpath(log, ROOT),
                        "summary": summary(name, log)})
        print(f"{name:>22}: {'ok' if rc == 0 else f'FAILED (rc {rc})'} in {wall:.0f} s",
              flush=True)
    total = time.perf_counter() - t_start
    ok = all(r["rc"] == 0 for r in results)
    info = {}
    if results and results[0]["rc"] == 0 and results[0]["summary"]:
        try:
            info = json.loads(results[0]["summary"][0])
        except ValueError:
            pass
    benches = {}
    for r in results:
        path = os.path.join(args.out, f"gpu-{r['step']}.json")
        if r["step"] != "info" and r["rc"] == 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                benches[r["step"]] = json.load(f)
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "mode": "simulator" if args.simulate else "gpu", "device": info.get("device"),
              "info": info, "ok": ok, "seconds": round(total, 1), "budget": args.budget,
              "steps": results, "benchmarks": benches}
    with open(os.path.join(args.out, "gpu-report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "gpu-report.txt"), "w", encoding="utf-8") as f:
        f.write(f"# hpccomm GPU check ({report['mode']}), {report['date']}\n")
        f.write(f"# device: {report['device']}\n")
        f.write(f"# {'passed' if ok else 'FAILED'} in {total:.0f} s (budget {args.budget:.0f} s)\n")
        for key, value in info.items():
            f.write(f"#   {key}: {value}\n")
        for r in results:
            state = "not run" if r["rc"] is None else "ok" if r["rc"] == 0 else f"rc {r['rc']}"
            f.write(f"\n## {r['step']}: {state}, {r['seconds']} s\n$ {r['command']}\n")
            f.writelines(line + "\n" for line in r["summary"])
    print(f"{'passed' if ok else 'FAILED'} in {total:.0f} s; report: "
          f"{os.path.join(args.out, 'gpu-report.txt')}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
