"""``python -m hpccomm`` (:mod:`hpccomm.info`): what it states is what MPI,
the registries and hpccomm's own rules say, on every rank and host; one block
per host under mpiexec, printed by rank 0 alone.

The tests marked ``mpi`` run under mpiexec at every rank count of
tests/run.py; the others start the command themselves (one rank, and
``mpiexec -n 2``) and look at the code."""
import ast
import json
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

import hpccomm
from hpccomm import cost_model, info
from hpccomm.__main__ import main, render
from hpccomm.buffers import mpi_cuda_support_reason
from hpccomm.collectives.auto import profile_location
from hpccomm.communicators import ranks_on_node
from hpccomm.kernels import threads

from .helpers import COMM, RANK, SIZE

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
ENV = {**os.environ, "NUMBA_NUM_THREADS": "1"}
PACKAGE = os.path.dirname(os.path.abspath(hpccomm.__file__))
LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
          MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def fact(report, name, rank):
    """Rank ``rank``'s ``name`` wherever the report states it: once for all
    ranks, in its host's facts, or per rank."""
    if name in report:
        return report[name]
    for host in report["hosts"]:
        if rank in host["ranks"]:
            if name in host["facts"]:
                return host["facts"][name]
            return host["per_rank"][name][str(rank)]
    raise KeyError(name)


def expected_hosts(names):
    """``[(host, [ranks])]`` in order of each host's first rank."""
    hosts = {}
    for rank, name in enumerate(names):
        hosts.setdefault(name, []).append(rank)
    return list(hosts.items())


# ------------------------------------------------------------------ under mpiexec
@pytest.mark.mpi
def test_collect_states_what_mpi_the_registries_and_hpccomm_say():
    report = info.collect(COMM)
    names = COMM.allgather(MPI.Get_processor_name())
    local = ranks_on_node(COMM)
    roots = COMM.bcast(report)
    assert report["ranks"] == SIZE
    assert [(h["host"], h["ranks"]) for h in report["hosts"]] == expected_hosts(names)
    mine = {k: fact(report, k, RANK) for k in (
        "hpccomm", "mpi_library", "thread_level_provided", "cuda_aware_mpi", "ranks_on_node",
        "hpccomm_threads", "codecs", "algorithms")}
    assert mine == {
        "hpccomm": hpccomm.__version__,
        "mpi_library": MPI.Get_library_version().strip(),
        "thread_level_provided": LEVELS[MPI.Query_thread()],
        "cuda_aware_mpi": dict(zip(("value", "reason"), mpi_cuda_support_reason())),
        "ranks_on_node": local,
        "hpccomm_threads": dict(zip(("value", "reason"), threads.for_node(local))),
        "codecs": list(hpccomm.available_codecs()),
        "algorithms": list(hpccomm.available_algorithms())}
    assert report == roots                          # the same report on every rank


@pytest.mark.mpi
def test_auto_profile_is_the_file_auto_would_read(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCCOMM_PROFILE", raising=False)
    path = profile_location(COMM)
    found = COMM.bcast(os.path.exists(path))        # rank 0 reads it, as auto does
    before = info.collect(COMM)["auto_profile"]
    mine = COMM.bcast(str(tmp_path / "profile.json"))
    if RANK == 0:
        cost_model.save({**cost_model.DEFAULT, "created": "2026-01-02T03:04:05",
                         "mode": "quick"}, mine)
    monkeypatch.setenv("HPCCOMM_PROFILE", mine)
    after = info.collect(COMM)["auto_profile"]
    assert before["value"] == path if found else before == {
        "value": "none", "reason": f"no file at {path}: the built-in defaults"}
    assert after["value"] == mine and after["reason"].startswith("calibrated 2026-01-02T03:04:05")


@pytest.mark.mpi(min_size=2)
def test_a_fact_that_differs_between_ranks_is_stated_per_rank(monkeypatch):
    monkeypatch.setenv("HPCCOMM_INFO_TEST", str(RANK))
    report = info.collect(COMM)
    assert "environment" not in report          # not one value for all ranks
    assert fact(report, "environment", RANK)["HPCCOMM_INFO_TEST"] == str(RANK)
    for host in report["hosts"]:
        if len(host["ranks"]) > 1:
            assert set(host["per_rank"]["environment"]) == {str(r) for r in host["ranks"]}


@pytest.mark.mpi
def test_main_prints_once_on_rank_0(capsys):
    assert main(["--json"]) == 0
    printed = capsys.readouterr().out
    assert main([]) == 0
    text = capsys.readouterr().out
    assert main(["info", "--json"]) == 0        # the command named: the same report
    named = capsys.readouterr().out
    if RANK > 0:
        assert printed == "" and text == "" and named == ""
        return
    report = json.loads(printed)
    assert json.loads(named).keys() == report.keys()
    hosts = len(report["hosts"])
    assert report["ranks"] == SIZE
    assert text.startswith(f"hpccomm {hpccomm.__version__}: {SIZE} rank")
    assert f"on {hosts} host" in text.splitlines()[0]
    assert sum(line.startswith("host ") for line in text.splitlines()) == hosts


# ------------------------------------------------------------------ the command itself
def run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_json_at_one_rank():
    proc = run([PY, "-m", "hpccomm", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ranks"] == 1
    assert [(h["host"], h["ranks"]) for h in report["hosts"]] == [(MPI.Get_processor_name(), [0])]
    # the subprocess holds the built-in codecs; this process may hold test-only ones too
    assert report["codecs"] == [c for c in hpccomm.available_codecs() if not c.startswith("test-")]
    assert report["algorithms"] == [a for a in hpccomm.available_algorithms()
                                    if not a.startswith("test-")]
    assert report["thread_level_provided"] == LEVELS[MPI.Query_thread()]
    assert report["cuda_aware_mpi"]["value"] == mpi_cuda_support_reason()[0]
    assert report["numba_threads"]["value"] == 1
    assert report["environment"]["NUMBA_NUM_THREADS"] == "1"
    assert render(report).startswith(f"hpccomm {hpccomm.__version__}: 1 rank on 1 host")


def test_two_ranks_print_one_host_block():
    proc = run(["timeout", "100", MPIEXEC, "-n", "2", PY, "-m", "hpccomm"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"hpccomm {hpccomm.__version__}: 2 ranks on 1 host", proc.stdout
    assert [line for line in lines if line.startswith("host ")] == [
        f"host {MPI.Get_processor_name()}: 2 ranks (0, 1)"]
    assert sum(line.startswith("hpccomm ") for line in lines) == 1     # rank 0 alone prints
    assert [line.split() for line in lines if line.split()[:1] == ["ranks_on_node"]] == [
        ["ranks_on_node", "2"]], proc.stdout


def test_help_and_bad_arguments():
    proc = run(["timeout", "100", MPIEXEC, "-n", "2", PY, "-m", "hpccomm", "--help"])
    assert proc.returncode == 0 and proc.stdout.count("usage: python -m hpccomm") == 1, proc.stdout
    assert "--json" in proc.stdout
    proc = run([PY, "-m", "hpccomm", "frobnicate"])
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_summarise_states_each_fact_where_it_has_one_value():
    ranks = [{"host": "a", "same": 1, "by_host": "x", "by_rank": 0},
             {"host": "b", "same": 1, "by_host": "y", "by_rank": 1},
             {"host": "a", "same": 1, "by_host": "x", "by_rank": 2, "only_here": True}]
    report = info.summarise(ranks, {"ranks": 3})
    assert report == {
        "same": 1, "ranks": 3,
        "hosts": [{"host": "a", "ranks": [0, 2], "facts": {"by_host": "x"},
                   "per_rank": {"by_rank": {"0": 0, "2": 2}, "only_here": {"0": None, "2": True}}},
                  {"host": "b", "ranks": [1], "facts": {"by_host": "y", "by_rank": 1,
                                                        "only_here": None}, "per_rank": {}}]}
    text = render(report)
    assert text.splitlines()[0] == f"hpccomm {hpccomm.__version__}: 3 ranks on 2 hosts"
    assert "host a: 2 ranks (0, 2)" in text and "rank 2: 2" in text


def test_nothing_in_hpccomm_imports_info():
    """The command sits on top: hpccomm never imports it (only ``__main__``)."""
    importers = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "__main__.py"):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    parts = [p for a in node.names for p in a.name.split(".")]
                elif isinstance(node, ast.ImportFrom):
                    parts = (node.module or "").split(".") + [a.name for a in node.names]
                else:
                    continue
                if "info" in parts:
                    importers.append(os.path.relpath(path, PACKAGE))
    assert importers == []
