"""``python -m hpccomm.slurm``: run hpccomm's batch templates on a Slurm cluster.

    python -m hpccomm.slurm [--template bench|bench-gpu|train|PATH] [--wait]
        [--mpi pmi2|pmix|mpiexec] [--out DIR] [sbatch options...] [-- job args]

Inside an allocation (``SLURM_JOB_ID`` is set, e.g. under ``salloc``) the
template runs directly, with ``srun`` inside it.  Otherwise it is submitted
with ``sbatch``; any option this command does not know (``--nodes=4``,
``--ntasks-per-node=1``, ``--partition=gpu``, ...) goes to sbatch, and
``--wait`` waits for the job and reports its final state and exit code
(non-zero when the job failed), polling ``scontrol`` every second (``sbatch
--wait``, used where there is no scontrol, sleeps 2, 8, then 32 s between its
checks: a 10-s job is reported after 42 s).  Arguments after ``--`` go to the job's command
(``hpccomm.bench allreduce`` for the bench templates, ``hpccomm.bench train``
for the train template).

Templates are the ``*.sbatch`` files of the repository's ``slurm/`` folder
(found next to the package in a source checkout, or in
``$HPCCOMM_SLURM_DIR``); ``--template PATH`` takes any file.  Which MPI
needs which srun plugin: the MPICH wheel works with ``--mpi=pmi2``, the Open
MPI wheel with ``--mpi=pmix``; a site MPI follows the site's documentation.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import List, Optional

ARG_VARS = {"bench": "HPCCOMM_BENCH_ARGS", "bench-gpu": "HPCCOMM_BENCH_ARGS",
            "train": "HPCCOMM_TRAIN_ARGS"}


def templates_dir() -> Optional[str]:
    env = os.environ.get("HPCCOMM_SLURM_DIR")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slurm")
    return here if os.path.isdir(here) else None


def find_template(name: str) -> str:
    if os.path.sep in name or name.endswith(".sbatch"):
        if not os.path.isfile(name):
            raise SystemExit(f"template {name!r} does not exist")
        return os.path.abspath(name)
    folder = templates_dir()
    if folder is None:
        raise SystemExit("cannot find hpccomm's slurm/ templates: set HPCCOMM_SLURM_DIR or pass "
                         "--template PATH")
    path = os.path.join(folder, f"{name}.sbatch")
    if not os.path.isfile(path):
        known = sorted(f[:-7] for f in os.listdir(folder) if f.endswith(".sbatch"))
        raise SystemExit(f"no template {name!r} in {folder}; known: {', '.join(known)}")
    return path


#: job states a job does not leave (``squeue --help``: the rest are PENDING, RUNNING, ...)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED"}


def job_state(job_id: str) -> dict:
    """JobState and ExitCode from ``scontrol show job`` (empty if unknown)."""
    if shutil.which("scontrol") is None:
        return {}
    try:
        proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {}
    fields = dict(re.findall(r"(\w+)=(\S+)", proc.stdout))
    return {k: fields[k] for k in ("JobState", "ExitCode", "StdOut") if k in fields}


def wait_for_job(job_id: str, poll: float = 1.0, misses: int = 10) -> dict:
    """Poll :func:`job_state` until the job is in a final state; returns its
    last state (empty when scontrol did not know the job ``misses`` times in
    a row: it forgets finished jobs after MinJobAge, 300 s by default)."""
    unknown = 0
    while True:
        state = job_state(job_id)
        if state.get("JobState") in FINAL_STATES:
            return state
        unknown = 0 if state else unknown + 1
        if unknown >= misses:
            return state
        time.sleep(poll)


def exit_status(state: dict) -> int:
    """The shell's status for a job's final state: its exit code, 128 + the
    signal that ended it, or 1 for a job that did not complete otherwise."""
    code, _, sig = state.get("ExitCode", "").partition(":")
    if code.isdigit() and int(code):
        return int(code)
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return 0 if state.get("JobState") == "COMPLETED" else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    job_args: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, job_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m hpccomm.slurm", description=__doc__.split("\n\n")[0],
                                epilog="Unknown options are passed to sbatch.")
    p.add_argument("--template", default="bench", help="bench, bench-gpu, train or a path")
    p.add_argument("--wait", action="store_true", help="wait for the job; exit with its status")
    p.add_argument("--mpi", default=None, help="srun --mpi plugin (pmi2, pmix) or 'mpiexec'")
    p.add_argument("--python", default=sys.executable,
                   help="python the job runs (default: this one)")
    p.add_argument("--out", default=None, help="directory for per-job output folders")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args, sbatch_opts = p.parse_known_args(argv)
    template = find_template(args.template)
    name = os.path.basename(template)[:-len(".sbatch")]
    env = dict(os.environ)
    env["HPCCOMM_PYTHON"] = args.python
    if args.mpi:
        env["HPCCOMM_MPI"] = args.mpi
    if args.out:
        env["HPCCOMM_OUT"] = os.path.abspath(args.out)
    if job_args:
        env[ARG_VARS.get(name, "HPCCOMM_BENCH_ARGS")] = " ".join(shlex.quote(a) for a in job_args)
    if os.environ.get("SLURM_JOB_ID"):
        if sbatch_opts:
            raise SystemExit(f"inside allocation {os.environ['SLURM_JOB_ID']}: sbatch options "
                             f"{sbatch_opts} do not apply")
        cmd = ["bash", template]
        if args.dry_run:
            print(" ".join(shlex.quote(c) for c in cmd))
            return 0
        return subprocess.run(cmd, env=env).returncode
    if shutil.which("sbatch") is None:
        raise SystemExit("sbatch not found: not on a Slurm cluster (and no SLURM_JOB_ID)")
    poll = args.wait and shutil.which("scontrol") is not None
    cmd = ["sbatch", "--parsable", *(["--wait"] if args.wait and not poll else []), *sbatch_opts,
           template]
    if args.dry_run:
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    job_id = proc.stdout.strip().split(";")[0].splitlines()[0] if proc.stdout.strip() else ""
    if not job_id:
        sys.stderr.write(proc.stderr)
        return proc.returncode or 1
    print(f"submitted job {job_id} ({name})")
    if not args.wait:
        return 0
    if poll:
        try:
            state = wait_for_job(job_id)
        except KeyboardInterrupt:
            print(f"stopped waiting; job {job_id} goes on (scancel {job_id} ends it)")
            return 130
        status = exit_status(state)
    else:
        state, status = job_state(job_id), proc.returncode
        if status != 0:
            sys.stderr.write(proc.stderr)
    print(f"job {job_id}: state {state.get('JobState', '?')}, exit code "
          f"{state.get('ExitCode', '?')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
