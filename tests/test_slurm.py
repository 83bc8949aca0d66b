"""Slurm for real: a one-machine cluster (munged, slurmctld, slurmd on
loopback) runs the bench and train templates with ``sbatch --wait``, and an
emulated two-host cluster (a network namespace, hostname and rate-limited NIC
per node: ``NetnsSlurm``) runs them across two nodes of two ranks through
``srun --mpi=pmi2``.  Installs Slurm from Debian's packages when missing;
skips with the reason when not root, apt is unavailable, or the kernel or
tools cannot emulate hosts."""
import collections
import json
import os
import subprocess
import sys

import pytest

from hpccomm.slurm import find_template, main as slurm_main

from .slurm_cluster import LocalSlurm, NetnsSlurm, ensure_installed, netns_problem

# Slurm's daemons and the emulated hosts' network namespaces, whose timeouts a loaded
# machine trips: run alone (tests/run.py)
pytestmark = pytest.mark.alone


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
    # --wait polls scontrol (found here) instead of sbatch --wait
    assert out.startswith("sbatch --parsable --nodes=2 ") and "bench.sbatch" in out


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
         "--ntasks-per-node=2", f"--output={tmp_path}/job-%j.out", "--",
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


# --- two emulated hosts -------------------------------------------------------

def _netns_reason():
    reason = _slurm_reason() or netns_problem()
    if reason:
        return reason
    from hpccomm.bench.netem import detect_mpi

    if detect_mpi() != "mpich":
        return "the jobs' MPI settings are MPICH's (srun --mpi=pmi2); this is Open MPI"
    return None


def _leftovers(cluster):
    """Namespaces of this cluster and processes started with its files, still there."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout.split()
    left = [name for name in spaces if name.startswith(cluster.prefix + "-")]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if cluster.tmp.encode() in f.read():
                    left.append(f"process {pid}")
        except OSError:
            pass
    return left


@pytest.fixture(scope="module")
def two_hosts():
    reason = _netns_reason()
    if reason:
        pytest.skip(f"emulated Slurm hosts unavailable: {reason}")
    cluster = NetnsSlurm(nodes=2, rate="1gbit")
    with cluster:
        yield cluster
    assert _leftovers(cluster) == [], "the emulated cluster left these behind"


def _submit_two_nodes(cluster, tmp_path, template, job_args):
    """Submit ``template`` from the head node on 2 nodes x 2 ranks through
    srun --mpi=pmi2 and wait; returns the job's output folder."""
    out = tmp_path / "runs"
    proc = subprocess.run(
        cluster.command([sys.executable, "-m", "hpccomm.slurm", "--template", template, "--wait",
                         "--mpi", "pmi2", "--out", str(out), "--nodes=2", "--ntasks-per-node=2",
                         f"--output={tmp_path}/job-%j.out", "--", *job_args]),
        env=cluster.env, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    job_out = "".join(p.read_text(errors="replace") for p in tmp_path.glob("job-*.out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + job_out + cluster.logs()
    assert "state COMPLETED, exit code 0:0" in proc.stdout
    (job_dir,) = list(out.iterdir())
    env = (job_dir / "env.txt").read_text()
    assert "nodes: node[0-1] tasks: 4" in env, env
    return job_dir


def _two_ranks_on_each_host(hosts):
    assert collections.Counter(hosts) == {"node0": 2, "node1": 2}, hosts


def test_two_hosts_have_rate_limited_nics(two_hosts):
    for i in range(two_hosts.nodes):
        qdisc = subprocess.run(["ip", "netns", "exec", two_hosts.net.host_ns(i), "tc", "qdisc",
                                "show", "dev", "veth0"], capture_output=True, text=True,
                               timeout=30).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc


def test_bench_hierarchical_across_two_hosts(two_hosts, tmp_path):
    job_dir = _submit_two_nodes(two_hosts, tmp_path, "bench", [
        "-m", "64K:64K", "-i", "2", "-x", "1", "--codec", "onebit",
        "--algorithm", "hierarchical"])
    data = json.loads((job_dir / "bench.json").read_text())
    assert data["meta"]["ranks"] == 4
    _two_ranks_on_each_host(data["meta"]["hosts"])
    rows = {r["algorithm_name"]: r for r in data["rows"]}
    assert rows["MPI_Allreduce"]["rel_err"] < 1e-6
    # MPI_COMM_TYPE_SHARED under srun's pmi2: the emulated hosts are the nodes
    assert (rows["hierarchical"]["nodes"], rows["hierarchical"]["ranks_per_node"]) == (2, 2)


def test_train_across_two_hosts(two_hosts, tmp_path):
    pytest.importorskip("sklearn")
    job_dir = _submit_two_nodes(two_hosts, tmp_path, "train", [
        "--dataset", "digits", "--codec", "onebit", "--algorithm", "hierarchical",
        "--epochs", "1", "--hidden", "16"])
    data = json.loads((job_dir / "train.json").read_text())
    assert data["meta"]["ranks"] == 4
    _two_ranks_on_each_host(data["meta"]["hosts"])
    (run,) = data["runs"]
    assert run["weights_identical"] and len(run["history"]) == 1
