#!/usr/bin/env python3
"""Run hpccomm's whole test suite: first the kernels compiled (one benchmark
job per core, :func:`warm_kernels`), then plain pytest (on every core,
pytest-xdist with work stealing; then the tests marked ``alone``, daemons and
network namespaces, with nothing beside them but the MPI runs at one rank),
then the MPI tests under ``mpiexec -n K`` for K = 1, 2, 3, 5 (those marked
``narrow``, layers above the collectives, at no more than :data:`NARROW`; the
tests marked ``wide``, the sparse algorithms and pipelined ``twoshot`` (the
latter at 4 only), at 4, 6 and 8 ranks too; the tests marked ``cudasim`` at 1
and 3 ranks under numba's CUDA simulator, and those also marked ``wide`` at
5), then the tests marked ``slow`` (messages beyond 2 GiB) once, at 2 ranks.
Each rank of an MPI run collects only the test files that hold a test its
run selects (each test's markers recorded by the plain run, which collects
every file, or by a ``--collect-only`` pass without it): collecting every
file took ~7 s per rank, and the runs start about 40 ranks in all.

    python tests/run.py [--ranks 1,2,3,5] [--wide-ranks 4,6,8] [--slow-ranks 2]
                        [--workers auto] [--warm-jobs CORES] [--timeout 900] [-- pytest args]

Every mpiexec is wrapped in a timeout, and each test has its own
(pytest-timeout, thread method: a hung rank dumps its stacks and exits, so
mpiexec tears the job down).  Ranks other than 0 log to build/test-logs/, which
are printed when a run fails.  The last line sums up all runs.
"""
import argparse
import concurrent.futures
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGDIR = os.path.join(ROOT, "build", "test-logs")
#: each test file's distinct sets of marker names, one per test (:func:`files_by_marker`)
MARKERS = os.path.join(ROOT, "build", "test-markers.json")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed).*?) in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def find_mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def run(label, cmd, timeout, env, out=None):
    """Run ``cmd``, its output (and, when it fails, its ranks' logs) to
    ``out`` (default: the console, as it comes); returns ``(exit code,
    {kind: count})`` from pytest's summary line."""
    if out is None:
        out = sys.stdout
    print(f"\n### {label}: {' '.join(cmd)}", file=out, flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "HPCCOMM_TEST_LABEL": label}, cwd=ROOT)
    summary = ""
    try:
        deadline = t0 + timeout
        for line in proc.stdout:
            out.write(line)
            m = SUMMARY.match(line.strip())
            if m:
                summary = m.group(1)
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
        proc.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"### {label}: TIMED OUT after {timeout}s", file=out, flush=True)
        return 124, {"failed": 1}
    counts = {}
    for num, kind in COUNT.findall(summary):
        kind = "errors" if kind.startswith("error") else kind
        counts[kind] = counts.get(kind, 0) + int(num)
    rc = proc.returncode
    if rc == 5 and not counts.get("failed"):  # pytest: nothing collected for this rank count
        rc = 0
    if rc != 0:
        for name in sorted(os.listdir(LOGDIR)) if os.path.isdir(LOGDIR) else []:
            if name.startswith(label + "-"):
                print(f"--- {name} ---", file=out)
                with open(os.path.join(LOGDIR, name), encoding="utf-8", errors="replace") as f:
                    out.write(f.read()[-20000:])
    print(f"### {label}: exit {rc} in {time.time() - t0:.0f}s", file=out, flush=True)
    return rc, counts


#: the most ranks the tests marked ``narrow`` run at (layers above the
#: collectives, whose collectives the other tests run at every count)
NARROW = 3

#: the built-in codecs, costliest to compile first (a warm-up job's run of one
#: codec on an empty cache less the same run cached, seconds, 2026-12-03: qsgd
#: 10.4, terngrad 9.8, onebit 8.1, powersgd 7.2, dgc 6.6, ebq 6.4, fp8 5.7,
#: adaptive 5.6, fp16 4.4, bf16 4.3, randk 2.7, threshold 2.5, topk 1.6, none
#: 0.4); the warm-up jobs take them round robin
WARM_CODECS = ("qsgd", "terngrad", "onebit", "powersgd", "dgc", "ebq", "fp8", "adaptive", "fp16",
               "bf16", "randk", "threshold", "topk", "none")


def share_bytecode(env):
    """Let the processes started with ``env`` write and load compiled bytecode,
    in one cache outside the tree (``build/pycache``, unless the caller chose
    a ``PYTHONPYCACHEPREFIX``).  The suite starts ~600 processes (workers,
    ranks, the jobs the tests start); with no bytecode written each compiled
    hpccomm and the test modules again (an import of hpccomm 0.9 against 0.5
    s, a rank's collection 2.6 against 1.2 s).  Python replaces ``.pyc``
    files atomically, so ranks that start together do not race."""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(ROOT, "build", "pycache"))


def warm_kernels(mpiexec, env, jobs, timeout):
    """Compile the kernels the codecs' collectives call, before the tests:
    ``jobs`` benchmark runs at 2 ranks at once, each on its share of
    :data:`WARM_CODECS` through ``twoshot``, ``allgather`` and
    ``sparse_allgather``, under ``HPCCOMM_COMPILE_LOCK`` (set by main), so
    that each kernel is compiled once and the test workers, ranks and
    benchmark subprocesses load it from numba's cache.  On a fresh clone the
    workers otherwise wait on each other's compiles, one core idle.  A failed
    job only costs the tests their compiles: the tests report what broke."""
    t0 = time.time()
    procs = []
    for j in range(jobs):
        codecs = ",".join(WARM_CODECS[j::jobs])
        cmd = [mpiexec, "-n", "2", sys.executable, "-m", "hpccomm.bench", "allreduce", "-m",
               "64K:64K", "-i", "1", "-x", "0", "--no-progress", "--codec", codecs,
               "--algorithm", "twoshot,allgather,sparse_allgather"]
        procs.append((codecs, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True, env=env,
                                               cwd=ROOT)))
    for codecs, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1, t0 + timeout - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"### warm ({codecs}): exit {proc.returncode}\n{out[-4000:]}", flush=True)
    print(f"\n### warm: the kernels of {len(WARM_CODECS)} codecs compiled by {jobs} jobs "
          f"in {time.time() - t0:.0f}s", flush=True)


def files_by_marker(base_cmd, env):
    """``{test file: [set of marker names of a test, ...]}`` (each distinct
    set once), from :data:`MARKERS` as the plain run wrote it while it
    collected every file (``pytest_collection_modifyitems`` in
    tests/conftest.py), or else from one ``--collect-only`` pass; None when
    that fails too (each run then collects the whole directory, and shows the
    error)."""
    if not os.path.exists(MARKERS):
        proc = subprocess.run(base_cmd + ["--collect-only"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env={**env, "HPCCOMM_TEST_MARKERS": MARKERS})
        if proc.returncode != 0 or not os.path.exists(MARKERS):
            print("### collect-only failed: every run collects all of tests/", flush=True)
            return None
    with open(MARKERS, encoding="utf-8") as f:
        data = json.load(f)
    if not (isinstance(data, dict) and all(
            isinstance(sets, list) and all(isinstance(marks, list)
                                           and all(isinstance(m, str) for m in marks)
                                           for marks in sets)
            for sets in data.values())):
        print(f"### {MARKERS}: not a map of marker sets: every run collects all of tests/",
              flush=True)
        return None
    return {name: [set(marks) for marks in sets] for name, sets in data.items()}


def run_markers(kind, k=1):
    """``(required, excluded)``: the markers that the tests of run ``kind``
    (``plain``, ``alone``, ``mpi``, ``cudasim``, ``wide``, ``slow``) at ``k``
    ranks carry, and those they do not."""
    if kind == "plain":
        return [], ["mpi", "alone"]
    if kind == "alone":
        return ["alone"], ["mpi"]
    if kind == "mpi":
        return ["mpi"], ["slow", "cudasim", *(["narrow"] if k > NARROW else [])]
    if kind == "cudasim":      # beyond 4 ranks only what needs them
        return ["mpi", "cudasim", *(["wide"] if k > 4 else [])], ["slow"]
    if kind == "wide":
        return ["mpi", "wide"], ["slow"]
    if kind == "slow":
        return ["mpi", "slow"], []
    raise ValueError(f"no run {kind!r}")


def selection(required, excluded=()):
    """The ``-m`` expression of the tests that carry every marker of
    ``required`` and none of ``excluded``."""
    return " and ".join([*required, *(f"not {m}" for m in excluded)])


def paths_for(files, required, excluded=()):
    """The test files that hold a test :func:`selection` selects -- or
    ``["tests"]`` without the marker map.  A file none of whose tests run is
    not collected: its imports (torch, mnist1d) cost each rank seconds."""
    if files is None:
        return ["tests"]
    required, excluded = set(required), set(excluded)
    return sorted(name for name, sets in files.items()
                  if any(required <= marks and not marks & excluded for marks in sets))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=os.environ.get("HPCCOMM_TEST_RANKS", "1,2,3,5"),
                    help="comma-separated rank counts for the MPI tests (default 1,2,3,5: one, even, odd, and more than four packets per owner)")
    ap.add_argument("--cudasim-ranks", default=os.environ.get("HPCCOMM_TEST_CUDASIM_RANKS",
                                                               "1,3,5"),
                    help="rank counts of the device-path tests under numba's CUDA simulator "
                         "(beyond 4 ranks only those also marked 'wide')")
    ap.add_argument("--wide-ranks", default=os.environ.get("HPCCOMM_TEST_WIDE_RANKS", "4,6,8"),
                    help="rank counts for the tests marked 'wide' (default 4,6,8: the sparse "
                         "algorithms at powers of two and between them)")
    ap.add_argument("--slow-ranks", default=os.environ.get("HPCCOMM_TEST_SLOW_RANKS", "2"),
                    help="rank counts for the tests marked 'slow' (default 2; empty: skip them)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec run")
    ap.add_argument("--test-timeout", type=int, default=240, help="seconds per test")
    ap.add_argument("--no-plain", action="store_true", help="skip the non-MPI tests")
    ap.add_argument("--workers", default=os.environ.get("HPCCOMM_TEST_WORKERS", "auto"),
                    help="pytest-xdist processes for the non-MPI tests (default auto: one per "
                         "core; 0: none); those marked 'alone' run after them, with only the "
                         "MPI runs at one rank beside them")
    ap.add_argument("--warm-jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="benchmark jobs that compile the kernels before the tests (default: "
                         "one per core; 0: none)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()

    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("mpiexec not found: install an MPI (pip install 'hpccomm[mpich]')", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", "1")   # ranks already share the cores
    # idle OpenBLAS threads spin and steal the cores MPI ranks busy-poll on
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # the workers and the ranks and benchmarks the tests start all meet the same
    # kernels first on an empty cache: each kernel compiled once between them
    env.setdefault("HPCCOMM_COMPILE_LOCK", "1")
    env["HPCCOMM_TEST_LOGDIR"] = LOGDIR
    share_bytecode(env)
    shutil.rmtree(LOGDIR, ignore_errors=True)
    os.makedirs(os.path.dirname(MARKERS), exist_ok=True)
    for stale in [MARKERS, *glob.glob(MARKERS + ".*.part")]:   # a killed run's leftovers too
        if os.path.exists(stale):
            os.remove(stale)
    # no:logging: pytest's log capture attaches a handler to every non-propagating
    # logger (torch makes dozens) around each test phase, 6 % of an MPI run's time,
    # and no test reads captured logs
    opts = ["-p", "no:cacheprovider", "-p", "no:logging", "--color=no", "-q",
            f"--timeout={args.test_timeout}",
            "--timeout-method=thread", *args.pytest_args]
    pytest = [sys.executable, "-m", "pytest"]
    base = pytest + ["tests"] + opts
    total, results = {}, []
    if args.warm_jobs:
        warm_kernels(mpiexec, env, args.warm_jobs, args.timeout)
    if not args.no_plain:
        workers = [] if args.workers in ("0", "") else ["-n", args.workers, "--dist", "worksteal"]
        plain = ["-m", selection(*run_markers("plain")), *workers]
        results.append(("plain",) + run("plain", base + plain, args.timeout,
                                        {**env, "HPCCOMM_TEST_MARKERS": MARKERS}))
    rank_counts = {name: [int(v) for v in getattr(args, name).split(",") if v.strip()]
                   for name in ("ranks", "cudasim_ranks", "wide_ranks", "slow_ranks")}
    files = (files_by_marker(base, env) if any(rank_counts.values()) or not args.no_plain
             else None)

    def chosen(kind, k=1):
        """``(-m expression, files that hold its tests)`` of run ``kind`` at
        ``k`` ranks (:func:`run_markers`)."""
        required, excluded = run_markers(kind, k)
        return selection(required, excluded), paths_for(files, required, excluded)

    def ranked(label, kind, k, env, out=None):
        """Run the tests of run ``kind`` under mpiexec -n k, each rank's
        pytest on the files that hold them (none: nothing to run)."""
        expr, paths = chosen(kind, k)
        if not paths:
            print(f"\n### {label}: no test file has {expr} tests", file=out or sys.stdout,
                  flush=True)
            return label, 0, {}
        cmd = [mpiexec, "-n", str(k), sys.executable, os.path.join(ROOT, "tests", "rankexec.py"),
               *pytest, *paths, *opts, "-m", expr, "--with-mpi"]
        return (label,) + run(label, cmd, args.timeout, env, out)

    def mpi_run(k, out=None):
        return ranked(f"mpi-n{k}", "mpi", k, env, out)

    def cudasim_run(k, out=None):
        return ranked(f"cudasim-n{k}", "cudasim", k, {**env, "NUMBA_ENABLE_CUDASIM": "1"}, out)

    if not args.no_plain:
        # the tests marked alone keep a core busy about half the time: the MPI
        # runs at one rank go beside them, their output shown when both end
        side = []
        if 1 in rank_counts["ranks"]:
            side.append(("mpi-n1", mpi_run))
        if 1 in rank_counts["cudasim_ranks"]:
            side.append(("cudasim-n1", cudasim_run))
        rank_counts["ranks"] = [k for k in rank_counts["ranks"] if k != 1]
        rank_counts["cudasim_ranks"] = [k for k in rank_counts["cudasim_ranks"] if k != 1]
        side_out = io.StringIO()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            beside = [pool.submit(f, 1, side_out) for _, f in side]
            expr, paths = chosen("alone")
            if paths:
                results.append(("alone",) + run("alone", pytest + paths + opts + ["-m", expr],
                                                args.timeout, env))
            if beside:
                print(f"\n### waiting for the runs beside it: "
                      f"{', '.join(label for label, _ in side)}", flush=True)
            results.extend(f.result() for f in beside)
        except BaseException:       # Ctrl-C, or a run that could not start: nothing more
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            sys.stdout.write(side_out.getvalue())
            sys.stdout.flush()
        pool.shutdown()
    for k in rank_counts["ranks"]:
        results.append(mpi_run(k))
    for k in rank_counts["cudasim_ranks"]:
        results.append(cudasim_run(k))
    for k in rank_counts["wide_ranks"]:
        results.append(ranked(f"wide-n{k}", "wide", k, env))
    for k in rank_counts["slow_ranks"]:
        results.append(ranked(f"slow-n{k}", "slow", k, env))
    print("\n### summary")
    failed_runs = []
    for label, rc, counts in results:
        for kind, num in counts.items():
            total[kind] = total.get(kind, 0) + num
        print(f"  {label:10s} exit {rc:3d}  " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        if rc != 0:
            failed_runs.append(label)
    failed = total.get("failed", 0) + total.get("errors", 0)
    if failed_runs and failed == 0:
        failed = len(failed_runs)
    print(f"total: {total.get('passed', 0)} passed, {failed} failed, "
          f"{total.get('skipped', 0)} skipped")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
