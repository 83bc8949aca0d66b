"""Slurm for real: a one-machine cluster (munged, slurmctld, slurmd on
loopback) runs the benchmark template with ``sbatch --wait``.  Installs Slurm
from Debian's packages when missing; skips with the reason when not root or
apt is unavailable."""
import json
import os
import subprocess
import sys

import pytest

from hpccomm.slurm import find_template, main as slurm_main

from .slurm_cluster import LocalSlurm, ensure_installed


def test_templates_are_found_and_documented():
    for name in ("bench", "bench-gpu", "train"):
        path = find_template(name)
        with open(path) as f:
            text = f.read()
        assert text.startswith("#!/bin/bash\n# hpccomm"), path
        assert "#SBATCH" in text and "python" in text.lower()
    with pytest.raises(SystemExit, match="no template 'nosuch'"):
        find_template("nosuch")


def test_dry_run_builds_the_sbatch_command(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    assert slurm_main(["--dry-run", "--wait", "--nodes=2", "--", "-m", "4K:1M"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sbatch --parsable --wait --nodes=2 ") and "bench.sbatch" in out


def test_inside_an_allocation_rejects_sbatch_options(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    with pytest.raises(SystemExit, match="do not apply"):
        slurm_main(["--nodes=2"])


def _slurm_reason():
    if os.geteuid() != 0:
        return "not root: cannot start slurmd/munged"
    return ensure_installed()


@pytest.fixture(scope="module")
def cluster():
    reason = _slurm_reason()
    if reason:
        pytest.skip(f"Slurm unavailable: {reason}")
    with LocalSlurm() as c:
        yield c


@pytest.mark.parametrize("mpi", ["pmi2", "mpiexec"])
def test_sbatch_bench_template(cluster, tmp_path, mpi):
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "hpccomm.slurm", "--wait", "--mpi", mpi, "--out", str(out),
         "--ntasks=2", f"--output={tmp_path}/job-%j.out", "--",
         "-m", "4K:64K", "-f", "16", "-i", "3", "-x", "1", "--csv", str(tmp_path / "a b.csv")],
        env=cluster.env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.logs()
    assert "state COMPLETED, exit code 0:0" in proc.stdout
    (job_dir,) = list(out.iterdir())
    data = json.loads((job_dir / "bench.json").read_text())
    assert data["meta"]["ranks"] == 2
    assert {r["size"] for r in data["rows"]} == {4096, 65536}
    assert "MPI_Allreduce" in (job_dir / "bench.txt").read_text()
    assert (tmp_path / "a b.csv").exists()     # an argument with a space arrives as one word


def test_sbatch_train_template(cluster, tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "hpccomm.slurm", "--template", "train", "--wait", "--out", str(out),
         "--ntasks=2", f"--output={tmp_path}/job-%j.out", "--",
         "--dataset", "digits", "--codec", "none,topk", "--epochs", "2", "--hidden", "32"],
        env=cluster.env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.logs()
    assert "state COMPLETED, exit code 0:0" in proc.stdout
    (job_dir,) = list(out.iterdir())
    data = json.loads((job_dir / "train.json").read_text())
    assert data["meta"]["ranks"] == 2
    assert [r["codec_name"] for r in data["runs"]] == ["none", "topk"]
    assert all(r["weights_identical"] and len(r["history"]) == 2 for r in data["runs"])


def test_failing_job_reports_failure(cluster, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hpccomm.slurm", "--wait", "--out", str(tmp_path / "runs"),
         "--ntasks=1", f"--output={tmp_path}/job-%j.out", "--", "--codec", "nosuchcodec"],
        env=cluster.env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "state FAILED" in proc.stdout
