"""The benchmark commands, run for real (mpiexec in a subprocess)."""
import copy
import json
import os
import subprocess
import sys
import time

import pytest

from hpccomm.bench.netem import parse_rate

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
ENV = {**os.environ, "NUMBA_NUM_THREADS": "1"}


def run(args, timeout=240):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)


def bench(ranks, *args, timeout=240):
    return run([MPIEXEC, "-n", str(ranks), PY, "-m", "mpi4py", "-m", "hpccomm.bench", *args],
               timeout=timeout)


ROW_KEYS = {"size", "count", "codec", "algorithm", "codec_name", "algorithm_name",
            "time_median", "time_min", "time_max", "iterations", "algbw", "busbw", "wire_bytes",
            "ratio", "speedup", "rel_err", "max_err", "t_encode", "t_comm", "t_decode",
            "error_feedback"}
META_KEYS = {"tool", "mpi", "mpi4py", "numpy", "numba", "ranks", "threads", "date", "cases"}


@pytest.mark.parametrize("ranks", [1, 3])
def test_allreduce_json_schema(tmp_path, ranks):
    out = tmp_path / "r.json"
    csv = tmp_path / "r.csv"
    proc = bench(ranks, "allreduce", "-m", "4:4K", "-f", "32", "-i", "3", "-x", "1",
                 "--algorithm", "mpi,twoshot,allgather", "-J", str(out), "--csv", str(csv))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# hpccomm allreduce benchmark")
    assert any(line.startswith("# ranks: %d" % ranks) for line in lines)
    data = json.loads(out.read_text())
    assert META_KEYS <= set(data["meta"]) and data["meta"]["ranks"] == ranks
    assert data["meta"]["threads"] == 1
    rows = data["rows"]
    # sizes 4, 128, 4096; cases MPI_Allreduce, none+mpi, none+twoshot, none+allgather
    assert len(rows) == 3 * 4
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["time_min"] <= row["time_median"] <= row["time_max"]
        assert row["rel_err"] < 1e-6
    assert {r["algorithm_name"] for r in rows} == {"MPI_Allreduce", "mpi", "twoshot", "allgather"}
    assert all(r["speedup"] == 1.0 for r in rows if r["algorithm_name"] == "MPI_Allreduce")
    assert csv.read_text().splitlines()[0].startswith("codec,")
    rep = run([PY, "-m", "hpccomm.bench", "report", str(out), "--rate", "1gbit"])
    assert rep.returncode == 0, rep.stderr
    table = [line for line in rep.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows) and "measured / floor" in table[0]
    # the floor of a case with wire bytes w at 1 Gbit/s is at least w * 8 ns
    big = max(rows, key=lambda r: (r["size"], r["algorithm_name"] == "twoshot"))
    if big["wire_bytes"]:
        from hpccomm.bench.report import floor_seconds

        assert floor_seconds(big, 1e9) >= big["wire_bytes"] * 8e-9


#: what a row computes, as against how long it took: the same in either --order
SAME_IN_EITHER_ORDER = ("result_hash", "fresh_hash", "wire_bytes", "segments", "rel_err",
                        "iterations", "wrong", "reference_ok", "gain", "error_feedback")


def test_interleaved_order_times_the_same_calls_side_by_side(tmp_path):
    """--order interleaved: the same calls as blocks (every row's last timed
    result and fresh result have the same bits, with the same bytes sent,
    --check's verdicts and statistics), but each size's cases run
    side by side -- every case's timed iterations overlap every other's in
    time, where blocks run them one after the other.  The spans, put on the
    clock_start of the JSON, fall within the run on this process's clock."""
    spans, hashes = {}, {}
    for order in ("blocks", "interleaved"):
        out = tmp_path / f"{order}.json"
        before = time.perf_counter()
        proc = bench(3, "allreduce", "-m", "4K:16K", "-i", "3", "-x", "1", "--codec", "onebit",
                     "--algorithm", "twoshot,allgather", "--order", order, "--check",
                     "-J", str(out))
        after = time.perf_counter()
        assert proc.returncode == 0, proc.stderr
        data = json.loads(out.read_text())
        assert data["meta"]["order"] == order
        rows = data["rows"]
        # the spans on the machine's monotonic clock, which this process reads too
        start = data["meta"]["clock_start"]
        assert before < start + rows[0]["span"][0] <= start + rows[-1]["span"][1] < after
        assert [r["size"] for r in rows] == [4096] * 4 + [16384] * 4
        hashes[order] = [tuple(r[k] for k in SAME_IN_EITHER_ORDER) for r in rows]
        assert all(r["wrong"] in (None, 0) and r["reference_ok"] in (None, True) for r in rows)
        spans[order] = [[r["span"] for r in rows if r["size"] == size] for size in (4096, 16384)]
    assert hashes["blocks"] == hashes["interleaved"]
    for size in spans["blocks"]:          # one case after another
        assert all(a[1] <= b[0] for a, b in zip(size, size[1:])), size
    for size in spans["interleaved"]:     # every pair overlaps
        assert max(s[0] for s in size) < min(s[1] for s in size), size


@pytest.mark.parametrize("order", ["blocks", "interleaved"])
def test_timed_rows_order(order):
    """timed_rows' schedule, with cases that log their calls: blocks builds,
    warms and times each case before the next is built; interleaved builds
    and warms every case, then each round times every case once, starting
    one case later than the round before."""
    from hpccomm.bench.allreduce import timed_rows

    log = []

    class Logged:
        def __init__(self, name):
            self.name, self.span = name, [None, None]
            log.append(("build", name))

        def warm(self, warmup):
            log.append(("warm", self.name, warmup))

        def step(self):
            log.append(("step", self.name))

        def row(self):
            log.append(("row", self.name))
            return {"case": self.name}

    makers = [lambda n=n: Logged(n) for n in "abc"]
    rows = list(timed_rows(makers, 4, 2, order, on_step=lambda j: log.append(("tick", j))))
    assert [r["case"] for r in rows] == ["a", "b", "c"]
    # each timed iteration is followed by one tick naming its case
    ticks = [i for i, e in enumerate(log) if e[0] == "tick"]
    assert len(ticks) == 12 and all(log[i - 1] == ("step", "abc"[log[i][1]]) for i in ticks)
    log[:] = [e for e in log if e[0] != "tick"]
    if order == "blocks":
        assert log == [e for n in "abc" for e in
                       [("build", n), ("warm", n, 2), *[("step", n)] * 4, ("row", n)]]
    else:
        steps = [n for kind, n, *_ in log if kind == "step"]
        assert log[:6] == [("build", n) for n in "abc"] + [("warm", n, 2) for n in "abc"]
        assert steps == list("abc" "bca" "cab" "abc")
        assert log[-3:] == [("row", n) for n in "abc"]
    with pytest.raises(ValueError, match="order must be one of"):
        list(timed_rows(makers, 4, 2, order.upper()))


@pytest.mark.parametrize("how", ["env", "launcher"])
def test_bound_ranks_count_the_node_cores(tmp_path, how):
    """HPCCOMM_BENCH_BIND=core pins rank r to the (r mod count)-th CPU it may
    use; either way of binding, the run records the node's CPUs (the union
    of the ranks'), not the one each rank keeps."""
    out = tmp_path / "r.json"
    env = {**ENV, "HPCCOMM_BENCH_BIND": "core"} if how == "env" else ENV
    launch = [MPIEXEC, "-n", "3"] if how == "env" else [MPIEXEC, "-bind-to", "core", "-n", "3"]
    proc = subprocess.run(launch + [PY, "-m", "mpi4py", "-m", "hpccomm.bench", "allreduce",
                                    "-m", "4K:4K", "-i", "2", "-x", "0", "--algorithm", "mpi",
                                    "-J", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(out.read_text())["meta"]
    cpus = sorted(os.sched_getaffinity(0))
    affinity = meta["affinity"]
    assert all(len(a) == 1 for a in affinity), affinity
    if how == "env":        # the CPUs each rank had before it pinned itself
        assert meta["bind"] == "core" and affinity == [[cpus[r % len(cpus)]] for r in range(3)]
        assert meta["cores"] == len(cpus)
    else:                   # bound by the launcher: the CPUs the node's ranks hold
        assert meta["cores"] == len(set().union(*map(set, affinity))) == min(len(cpus), 3)


def test_bind_refuses_an_unknown_value():
    proc = subprocess.run([MPIEXEC, "-n", "1", PY, "-m", "hpccomm.bench", "calibrate"],
                          capture_output=True, text=True, timeout=120,
                          env={**ENV, "HPCCOMM_BENCH_BIND": "socket"})
    assert proc.returncode != 0 and "HPCCOMM_BENCH_BIND='socket'" in proc.stderr


PLUGIN = '''
import numpy as np
import hpccomm
from hpccomm.codecs.none import NoneCodec


@hpccomm.register_codec
class Corrupt(NoneCodec):
    """Claims to be lossless but decodes 0.1% too large: --check must notice."""
    name = "test-corrupt"
    codec_id = 240

    def _decode_into(self, packet, header, out, add):
        super()._decode_into(packet, header, out, add)
        out *= np.float32(1.001)
'''


def test_check_fails_on_a_corrupting_codec(tmp_path):
    (tmp_path / "corrupt_plugin.py").write_text(PLUGIN)
    env = {**ENV, "HPCCOMM_PLUGINS": "corrupt_plugin",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    out = tmp_path / "r.json"
    common = [MPIEXEC, "-n", "2", PY, "-m", "mpi4py", "-m", "hpccomm.bench", "allreduce", "-m",
              "4K:4K", "-i", "3", "-x", "1", "--algorithm", "twoshot", "--check"]
    proc = subprocess.run(common + ["--codec", "none,test-corrupt", "-J", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "# check: FAILED: 3 wrong iteration(s)" in proc.stdout
    assert "relative error above" in proc.stdout
    rows = {r["codec_name"]: r for r in json.loads(out.read_text())["rows"]
            if r["algorithm_name"] == "twoshot"}
    assert rows["test-corrupt"]["wrong"] == 3 and rows["none"]["wrong"] == 0
    # the fresh reducer matches its own pipeline, but not the lossless band
    assert not rows["test-corrupt"]["reference_ok"] and rows["none"]["reference_ok"]
    assert "rel_err 0.00" in rows["test-corrupt"]["reference_failures"][0]
    assert "outside the codec's band" in rows["test-corrupt"]["reference_failures"][0]
    clean = subprocess.run(common + ["--codec", "none"], capture_output=True, text=True,
                           timeout=240, env=env)
    assert clean.returncode == 0 and "# check: OK" in clean.stdout


ZERO_PLUGIN = '''
import hpccomm
from hpccomm.codecs.onebit import OneBitCodec
from hpccomm.codecs.topk import TopK


@hpccomm.register_codec
class ZeroOneBit(OneBitCodec):
    """onebit's packets, decoded to zeros: consistent with itself."""
    name = "test-zero-onebit"
    codec_id = 241
    encode_with_feedback = None
    owner_step = None

    def _decode_into(self, packet, header, out, add):
        if not add:
            out[:] = 0


@hpccomm.register_codec
class ZeroTopK(TopK):
    name = "test-zero-topk"
    codec_id = 242
    encode_with_feedback = None

    def _decode_into(self, packet, header, out, add):
        if not add:
            out[:] = 0

    def _pairs(self, x, ctx):
        idx, vals = super()._pairs(x, ctx)
        return idx, vals * 0
'''


def test_check_fails_on_a_zero_decoder(tmp_path):
    """A codec that decodes to zeros agrees with its own reference pipeline
    and stays within the sanity tolerance of every timed iteration: the
    codec's band (gain 0, rel_err 1) fails it, for every algorithm."""
    (tmp_path / "zero_plugin.py").write_text(ZERO_PLUGIN)
    env = {**ENV, "HPCCOMM_PLUGINS": "zero_plugin",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [MPIEXEC, "-n", "3", PY, "-m", "mpi4py", "-m", "hpccomm.bench", "allreduce", "-m",
         "64K:64K", "-i", "2", "-x", "1", "--check", "--codec",
         "onebit,test-zero-onebit,test-zero-topk", "--algorithm",
         "twoshot,allgather,sparse_allgather", "-J", str(out)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = [r for r in json.loads(out.read_text())["rows"] if r["codec_name"] != "-"]
    zero = {(r["codec_name"], r["algorithm_name"]): r for r in rows
            if r["codec_name"].startswith("test-zero")}
    assert len(zero) == 5       # onebit's zero variant is dense: sparse_allgather refuses it
    for r in zero.values():
        assert r["wrong"] == 0 and r["reference_ok"] is False, r
        assert r["gain"] == 0.0 and "gain 0 " in r["reference_failures"][0], r
    assert all(r["reference_ok"] for r in rows if r["codec_name"] in ("none", "onebit"))
    assert "# check: FAILED: 0 wrong iteration(s), 5 case(s) off" in proc.stdout


def test_allreduce_bad_arguments():
    for args, message in [
        (["-m", "1M:4K"], "bad size range"),
        (["-m", "lots"], "not a size"),
        (["--codec", "nosuch"], "unknown codec 'nosuch'"),
        (["--algorithm", "nosuch"], "unknown algorithm 'nosuch'"),
        (["--option", "ratio"], "KEY=VALUE"),
        (["--codec", "onebit", "--algorithm", "twoshot", "--option", "ratio=0.1"],
         "taken by none of the cases"),
    ]:
        proc = bench(1, "allreduce", *args)
        assert proc.returncode != 0, args
        assert message in proc.stderr + proc.stdout, (args, proc.stderr)


def test_report_rejects_other_json(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"runs": []}')
    proc = run([PY, "-m", "hpccomm.bench", "report", str(f)])
    assert proc.returncode != 0 and "not an allreduce result" in proc.stderr


def test_bench_help_and_unknown_command():
    proc = run([PY, "-m", "hpccomm.bench", "--help"])
    assert proc.returncode == 0 and "allreduce" in proc.stdout and "netem" in proc.stdout
    proc = run([PY, "-m", "hpccomm.bench", "frobnicate"])
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    # under mpiexec, rank 0 alone prints the help
    proc = bench(3, "allreduce", "--help")
    assert proc.returncode == 0 and proc.stdout.count("usage:") == 1, proc.stdout


def test_codecs_bench_runs(tmp_path):
    out = tmp_path / "c.json"
    proc = run([PY, "-m", "hpccomm.bench", "codecs", "--sizes", "4K", "--reps", "1",
                "-J", str(out)])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    names = {r["codec"].split("(")[0] for r in rows}
    import hpccomm

    # the subprocess has the built-in codecs; this process may hold test-only ones too
    assert names == {c for c in hpccomm.available_codecs() if not c.startswith("test-")}
    for r in rows:
        assert r["encode_gbs"] > 0 and r["decode_gbs"] > 0 and r["bits_per_element"] > 0


def test_codecs_bench_takes_rotated_codecs(tmp_path):
    """``--codec qsgd,qsgd+rotate``: both rows, an option scoped to ``qsgd``
    applying to the rotated one too."""
    out = tmp_path / "c.json"
    proc = run([PY, "-m", "hpccomm.bench", "codecs", "--codec", "qsgd,qsgd+rotate", "--option",
                "qsgd.norm=max", "--sizes", "4K", "--reps", "1", "-J", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert [r["codec"] for r in json.loads(out.read_text())["rows"]] == [
        "qsgd(bits=4,bucket=512,norm=max)",
        "qsgd+rotate(bits=4,bucket=512,norm=max,rotate=True,rotate_block=1024)"]


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    proc = bench(2, "allreduce", "-m", "4K:16K", "-f", "4", "-i", "2", "-x", "1",
                 "--algorithm", "twoshot", "-J", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = run([PY, "-m", "hpccomm.bench", "plot", str(out), "--out", str(tmp_path / "fig")])
    assert proc.returncode == 0, proc.stderr
    for kind in ("time", "speedup"):
        png = tmp_path / "fig" / f"r-{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_diverged_run_and_combined_accuracy_plot(tmp_path):
    """A run that diverges stops on every rank, is reported as such, and the
    accuracy figure of several train files (one with a diverged run) is drawn."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    proc = bench(2, "train", "--codec", "none", "--epochs", "2", "--hidden", "16", "-J", str(a))
    assert proc.returncode == 0, proc.stderr
    # a learning rate of 1e6 blows the weights up within an epoch
    proc = bench(2, "train", "--codec", "topk", "--epochs", "2", "--hidden", "16",
                 "--lr", "1e6", "--warmup-epochs", "0", "-J", str(b))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "diverged at step" in proc.stdout and "1 of 1 diverged" in proc.stdout
    run_b = json.loads(b.read_text())["runs"][0]
    assert run_b["diverged_at_step"] is not None and run_b["weights_identical"]
    proc = run([PY, "-m", "hpccomm.bench", "plot", str(a), str(b), "--combine", "both",
                "--out", str(tmp_path / "fig")])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fig" / "both-accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_netem_rate_parsing():
    assert parse_rate("1gbit") == "1gbit" and parse_rate("100mbit") == "100mbit"
    import argparse

    for bad in ("fast", "1gbps", "20gbit", "10kbit"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rate(bad)


def test_netem_refuses_without_root_or_tools():
    if os.geteuid() == 0:
        env = {**ENV, "PATH": "/nonexistent"}
        proc = subprocess.run([PY, "-m", "hpccomm.bench", "netem", "--ranks", "2", "--rate",
                               "1gbit"], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode != 0 and "netem needs 'ip'" in proc.stderr
    else:
        proc = run([PY, "-m", "hpccomm.bench", "netem", "--ranks", "2", "--rate", "1gbit"])
        assert proc.returncode != 0 and "needs root" in proc.stderr


def _netem_possible():
    import shutil

    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no '{tool}'"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    if probe.returncode != 0:
        return "ip netns unavailable"
    return None


# network namespaces, and a check that none is left behind: run alone (tests/run.py)
@pytest.mark.alone
@pytest.mark.skipif(_netem_possible() is not None, reason=f"netem: {_netem_possible()}")
@pytest.mark.parametrize("mode", ["per-host", "shared"])
def test_netem_tiny_run_and_teardown(tmp_path, mode):
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "n.json"
    proc = run([PY, "-m", "hpccomm.bench", "netem", "--ranks", "2", "--rate", "1gbit",
                "--mode", mode, "--", "-m", "64K:1M", "-f", "16", "-i", "2", "-x", "1",
                "--no-progress", "-J", str(out)], timeout=300)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"# netem: {mode}, 2 ranks, 1gbit" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    big = [r for r in rows if r["size"] == 1 << 20 and r["algorithm_name"] == "MPI_Allreduce"][0]
    # 1 MiB over 1 Gbit/s links cannot take less than the wire time
    assert big["time_median"] > (1 << 20) * 8 / 1e9 * 0.9
    assert sorted(after.split()) == sorted(before.split()), "namespaces left behind"


KILLED_RUN = """
import os, subprocess, sys
from hpccomm.bench.netem import Cluster
c = Cluster(1, "1gbit", "shared")
c.build()
# a process left inside, as a daemon of a killed Slurm test would be
subprocess.Popen(["ip", "netns", "exec", c.host_ns(0), "sleep", "300"], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(c.host_ns(0), flush=True)
os._exit(0)          # killed before close(): the namespace stays behind
"""


@pytest.mark.alone
@pytest.mark.skipif(_netem_possible() is not None, reason=f"netem: {_netem_possible()}")
def test_a_killed_runs_namespaces_go_with_the_next_run():
    from hpccomm.bench.netem import Cluster, remove_stale

    def names():
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    def inside(ns):
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return out.split()

    proc = subprocess.run([PY, "-c", KILLED_RUN], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    left = proc.stdout.split()[0]
    deadline = time.time() + 10
    while not inside(left) and time.time() < deadline:     # the sleep has entered it
        time.sleep(0.1)
    assert left in names() and inside(left)
    live = Cluster(1, "1gbit", "shared", prefix=f"hpcclive{os.getpid() % 100000}")
    try:
        live.build()           # the next run: the dead owner's namespace and process go
        assert left not in names()
        assert live.host_ns(0) in names()
        # a live owner's namespaces stay, and names this module did not make too
        subprocess.run(["ip", "netns", "add", "hpcc-other-test"], check=True)
        try:
            assert remove_stale() == []
            assert live.host_ns(0) in names() and "hpcc-other-test" in names()
        finally:
            subprocess.run(["ip", "netns", "delete", "hpcc-other-test"])
    finally:
        live.close()
    assert live.host_ns(0) not in names()


def test_sparse_bench_runs():
    proc = run([MPIEXEC, "-n", "2", PY, "-m", "mpi4py", "-m", "hpccomm.bench.sparse_allreduce", "-n", "4K",
                "-d", "0.01,0.5", "-i", "1", "-x", "0"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# hpccomm sparse allreduce benchmark: n=4096")
    rows = [line.split() for line in lines if not line.startswith("#") and line.strip()][1:]
    import hpccomm

    names = {"MPI_Allreduce", "kylix+cache", *hpccomm.sparse_algorithms()}
    assert len(rows) == 2 * len(names) and {r[1] for r in rows} == names
    assert all(float(r[5]) < 1e-6 for r in rows)      # rel_err against the exact sum
    proc = bench(1, "sparse", "-n", "1K", "-i", "1", "-a", "nosuch")
    assert proc.returncode != 0 and "unknown sparse algorithm" in proc.stderr
    proc = bench(1, "sparse", "-n", "1K", "-i", "0")
    assert proc.returncode == 2 and "--iterations must be at least 1" in proc.stderr


def test_every_codec_with_its_own_options_and_check(tmp_path):
    """All built-in codecs through twoshot and topk through the sparse algorithms,
    with per-codec options, validated by --check at an odd rank count."""
    import hpccomm
    from hpccomm.codecs import packet_codecs

    codecs = [c for c in packet_codecs() if not c.startswith("test-")]
    out = tmp_path / "r.json"
    proc = bench(3, "allreduce", "-m", "8K:8K", "-i", "3", "-x", "1", "--check",
                 "--codec", ",".join(codecs), "--algorithm", "twoshot",
                 "--option", "topk.ratio=0.05", "--option", "bits=8", "-J", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    got = {r["codec_name"]: r["codec"] for r in rows if r["algorithm_name"] == "twoshot"}
    assert set(got) == set(codecs)
    assert "ratio=0.05" in got["topk"] and "ratio=0.01" in got["randk"]
    assert "bits=8" in got["qsgd"]
    sparse = [a for a in hpccomm.sparse_algorithms()]
    proc = bench(3, "allreduce", "-m", "64K:64K", "-i", "2", "-x", "1", "--check",
                 "--codec", "topk", "--algorithm", ",".join(sparse), "-J", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["algorithm_name"] for r in rows} == {"MPI_Allreduce", "mpi", *sparse}


def test_report_floor_with_and_without_pipelining():
    """1 ms on the wire (125 kB at 1 Gbit/s) and 3 ms of kernels: one after
    the other unsegmented; in 4 segments the longer plus a quarter of the
    shorter."""
    from hpccomm.bench.report import floor_seconds

    row = {"wire_bytes": 125_000, "t_encode": 2e-3, "t_decode": 1e-3}
    assert floor_seconds(row, 1e9) == pytest.approx(4e-3)
    assert floor_seconds({**row, "segments": 4}, 1e9) == pytest.approx(3.25e-3)
    assert floor_seconds({**row, "segments": 4}, None) == pytest.approx(3e-3)


def test_report_names_the_term_that_misses_most(tmp_path):
    """An outlier's cause is the term whose prediction is furthest from its
    measured part; rows within 20 % are counted and not listed."""
    from hpccomm import cost_model
    from hpccomm.bench.report import cause, fmt_time as fmt, predicted

    row = {"time_median": 10e-3, "t_encode": 1e-3, "t_decode": 1e-3, "t_comm": 7e-3}
    # measured: Python 1 ms, kernels 2 ms, MPI 7 ms
    assert cause({"overhead": 1e-3, "kernels": 9e-3, "comm": 6e-3}, row).startswith(
        "kernels over-predicted: 9.0 ms predicted, 2.0 ms measured")
    assert cause({"overhead": 1e-3, "kernels": 2e-3, "comm": 1e-3}, row, ["x"]) == (
        "MPI under-predicted: 1.0 ms predicted, 7.0 ms measured; x")
    assert cause({"overhead": 4e-3, "kernels": 2e-3, "comm": 7e-3}, row).startswith(
        "per-call Python over-predicted")

    profile = copy.deepcopy(cost_model.DEFAULT)
    path = tmp_path / "p.json"
    cost_model.save(profile, str(path))
    model = cost_model.CostModel(profile)
    bare = model.pattern("allreduce", 4096)
    rows = [{"algorithm_name": "MPI_Allreduce", "codec_name": "-", "count": 1024, "size": 4096,
             "time_median": bare * t, "t_comm": bare * t} for t in (1.1, 2.0)]
    data = {"meta": {"ranks": 4, "hosts": ["a"] * 4, "cores": 2}, "rows": rows}
    text = predicted(data, str(path))
    assert "1 of 2 predictions within 20 %" in text
    outliers = [line for line in text.splitlines() if line.startswith("- ")]
    assert outliers == [f"- 4 KiB MPI_Allreduce: 0.50; MPI under-predicted: "
                        f"{fmt(bare)} predicted, {fmt(2 * bare)} measured; 2 ranks per core"]


def test_report_counts_apart_the_sizes_where_mpi_drifted(tmp_path):
    """A size whose bare MPI_Allreduce ran 2x its calibration: its rows are
    counted in all, not among the sizes where the machine matched its
    profile, and its outliers say how far the bare call was off."""
    import hpccomm
    from hpccomm import cost_model
    from hpccomm.bench.report import predicted

    profile = copy.deepcopy(cost_model.DEFAULT)
    path = tmp_path / "p.json"
    cost_model.save(profile, str(path))
    model = cost_model.CostModel(profile)
    none = hpccomm.get_codec("none")
    rows = []
    for n, slow in ((1024, 1.0), (4096, 2.0)):
        bare = sum(cost_model.predict_terms(model, None, "MPI_Allreduce", n, 4, (n,), 1).values())
        call = sum(cost_model.predict_terms(model, none, "mpi", n, 4, (n,), 1).values())
        rows += [{"algorithm_name": "MPI_Allreduce", "codec_name": "-", "count": n,
                  "size": 4 * n, "time_median": bare * slow, "t_comm": bare * slow},
                 {"algorithm_name": "mpi", "codec_name": "none", "count": n, "size": 4 * n,
                  "time_median": call * slow, "t_comm": call * slow}]
    text = predicted({"meta": {"ranks": 4}, "rows": rows}, str(path))
    assert "2 of 4 predictions within 20 %" in text
    assert ("At the 1 of 2 sizes whose bare MPI_Allreduce the profile predicts within 20 %: "
            "2 of 2") in text
    outliers = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(outliers) == 2 and outliers[0].startswith("- 16 KiB MPI_Allreduce: 0.50")
    assert outliers[1].startswith("- 16 KiB none+mpi: 0.50")
    assert outliers[1].endswith("; this size's bare MPI_Allreduce: 0.50")


@pytest.mark.parametrize("ranks", [1, 2])
def test_calibrate_writes_a_profile_that_auto_reads(tmp_path, ranks):
    """``calibrate --quick`` writes a valid profile whose numbers are
    measured (positive, growing with the message), and ``auto`` loads it."""
    from hpccomm import cost_model

    path = tmp_path / "profile.json"
    proc = bench(ranks, "calibrate", "--quick", "-o", str(path), "--codec", "onebit,fp16")
    assert proc.returncode == 0, proc.stderr
    profile = cost_model.validate(json.loads(path.read_text()))
    assert profile["machine"]["ranks"] == ranks
    for name in cost_model.PATTERNS:
        times = [t for _, t in profile["patterns"][name]]
        assert all(t > 0 for t in times) and times[-1] > times[0], (name, times)
    for codec in ("onebit", "fp16"):
        pts = profile["kernels"][codec]["encode"]
        assert len(pts) >= 2 and pts[-1][1] > pts[0][1] > 0, (codec, pts)
    # each codec's per-call cost, where there is a collective to run
    assert profile["calls"] == ({} if ranks == 1 else {
        c: {"twoshot": profile["calls"][c]["twoshot"],
            "allgather": profile["calls"][c]["allgather"]} for c in ("onebit", "fp16", "none")})
    script = ("import numpy as np, hpccomm; r = hpccomm.Allreducer(codec='onebit', "
              "algorithm='auto'); r(np.ones(10, np.float32), key='k'); "
              "print(r.algorithm.source)")
    env = {**ENV, "HPCCOMM_PROFILE": str(path)}
    got = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0 and got.stdout.strip() == str(path), got.stderr


def test_calibrate_that_cannot_write_exits_on_every_rank(tmp_path):
    """A profile path rank 0 cannot write (under a file): every rank exits
    with the same message, none waits for the others."""
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "profile.json"
    proc = bench(2, "calibrate", "--quick", "-o", str(path), "--codec", "onebit", timeout=120)
    assert proc.returncode != 0, proc.stdout
    said = "hpccomm calibrate: could not write the profile"
    assert (proc.stdout + proc.stderr).count(said) == 2, proc.stdout + proc.stderr


def test_allreduce_calibrates_in_its_own_launch(tmp_path):
    """``allreduce --calibrate FILE`` writes a profile of the sweep's codecs
    before the sweep, and ``auto`` decides by that file, not by the one in
    ``$HPCCOMM_PROFILE`` when the launch began."""
    from hpccomm import cost_model

    path, out = tmp_path / "profile.json", tmp_path / "r.json"
    elsewhere = tmp_path / "absent.json"
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", PY, "-m", "mpi4py", "-m", "hpccomm.bench", "allreduce",
         "-m", "4K:4K", "-i", "3", "-x", "1", "--codec", "onebit,topk",
         "--algorithm", "auto", "--no-progress", "--calibrate", str(path),
         "--calibrate-mode", "quick", "-J", str(out)],
        capture_output=True, text=True, timeout=240,
        env={**ENV, "HPCCOMM_PROFILE": str(elsewhere)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# hpccomm calibrate (quick, P = 2"), proc.stdout[:200]
    profile = cost_model.validate(json.loads(path.read_text()))
    assert sorted(profile["kernels"]) == ["*", "none", "onebit", "topk"]
    data = json.loads(out.read_text())
    assert data["meta"]["calibrated"] == str(path)
    autos = [r for r in data["rows"] if r["algorithm_name"] == "auto"]
    assert len(autos) == 2 and all(r["auto_profile"] == str(path) for r in autos), autos
    assert not elsewhere.exists()


def test_network_profiles_have_the_published_parameter_counts():
    from hpccomm.bench.networks import NETWORKS

    totals = {name: sum(f()) for name, f in NETWORKS.items()}
    assert totals == {"resnet50": 25_557_032, "vgg16": 138_357_544,
                      "bert-base": 109_482_240, "gpt2": 124_439_808}


def test_model_predictions():
    """The dense ring term by hand; compression pays at 1 Gbit/s and not on an
    absurdly fast link; overlap never makes a step slower."""
    from hpccomm import cost_model
    from hpccomm.bench import model

    costs = cost_model.CostModel(cost_model.DEFAULT)
    m = model.NetworkModel(costs, P=4, rate=1e9, alpha=1e-5)
    assert m.dense(1000) == pytest.approx(6 * (1e-5 + 4000 / 4e9) + costs.overhead["dense"])
    args = model.build_parser().parse_args(["--networks", "resnet50", "--ranks", "8",
                                            "--rates", "1,100000", "--codecs", "onebit"])
    rows = {(r["gbit"], r["codec"], r["overlap"]): r for r in model.run(args)}
    slow = rows[(1, "dense", True)]["step_s"] / rows[(1, "onebit", True)]["step_s"]
    fast = rows[(100000, "dense", True)]["step_s"] / rows[(100000, "onebit", True)]["step_s"]
    assert slow > 2 and fast == pytest.approx(1.0)
    assert rows[(100000, "onebit", True)]["compressed_buckets"] == 0
    for key, r in rows.items():
        if key[2]:
            assert r["step_s"] <= rows[(key[0], key[1], False)]["step_s"] + 1e-12


def test_overlap_bench_runs_and_records_every_variant(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "o.json"
    proc = bench(2, "overlap", "--width", "64", "--depth", "2", "--batch", "8", "--steps", "2",
                 "--warmup", "1", "--codec", "none,onebit", "--algorithm", "mpi,twoshot",
                 "-J", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["codec"], r["algorithm"]) for r in rows] == [("none", "mpi"), ("onebit", "twoshot")]
    for r in rows:
        assert all(r[k] > 0 for k in ("forward", "compute", "comm", "serial", "overlap"))
        assert r["model_serial"] == pytest.approx(r["compute"] + r["comm"])
    proc = bench(1, "overlap", "--codec", "none,onebit", "--algorithm", "mpi")
    assert proc.returncode != 0 and "one entry per codec" in proc.stderr


@pytest.mark.alone
@pytest.mark.skipif(_netem_possible() is not None, reason=f"netem: {_netem_possible()}")
def test_netem_ranks_per_host_makes_nodes(tmp_path):
    """--ranks-per-host 2 at 4 ranks: two emulated hosts of two ranks each;
    the hierarchical algorithm runs on them and passes --check."""
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "n.json"
    proc = run([PY, "-m", "hpccomm.bench", "netem", "--ranks", "4", "--ranks-per-host", "2",
                "--rate", "1gbit", "--", "-m", "1M:1M", "-i", "2", "-x", "1", "--no-progress",
                "--codec", "onebit", "--algorithm", "hierarchical", "--check", "-J", str(out)],
               timeout=300)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks, 1gbit" in proc.stdout and "2 ranks per host" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["ranks"] == 4
    assert sorted(data["meta"]["hosts"]) == ["r0", "r0", "r1", "r1"]
    (hier,) = [r for r in data["rows"] if r["algorithm_name"] == "hierarchical"]
    assert (hier["nodes"], hier["ranks_per_node"]) == (2, 2)
    assert sorted(after.split()) == sorted(before.split()), "namespaces left behind"
    bad = run([PY, "-m", "hpccomm.bench", "netem", "--ranks", "3", "--ranks-per-host", "2",
               "--rate", "1gbit"])
    assert bad.returncode != 0 and "--ranks-per-host must divide" in bad.stderr


def test_codecs_device_cuda_on_the_simulator(tmp_path):
    """``bench codecs --device cuda`` runs every device twin (here on numba's
    simulator: a functional run) and each packet equals the host codec's
    ``encode_with_feedback`` packet where the host has one."""
    out = tmp_path / "d.json"
    proc = subprocess.run([PY, "-W", "ignore", "-m", "hpccomm.bench", "codecs", "--device", "cuda",
                           "--sizes", "300", "--reps", "1", "-J", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**ENV, "NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    twins = {"none", "fp16", "bf16", "onebit", "terngrad", "qsgd", "topk", "dgc", "threshold",
             "adaptive", "randk"}
    names = {r["codec"].split("(")[0] for r in rows}
    assert twins <= names, names
    # every codec without a device twin is reported as such, and only those
    import hpccomm
    without = {c for c in hpccomm.available_codecs() if not c.startswith("test-")} - twins
    reported = {line.split()[0] for line in proc.stdout.splitlines() if "no device twin" in line}
    assert reported == without, (reported, without, proc.stdout)
    fused = [r for r in rows if r["same_packet_as_host"] is not None]
    assert fused and all(r["same_packet_as_host"] for r in fused), fused


def test_default_sweep_shape(tmp_path):
    # ./dev.sh bench's shape at tiny sizes: codecs crossed with auto, twoshot and
    # mpi print no "skipped" line for the pairs mpi cannot carry, name auto's
    # choice on its rows, and end with one line per codec
    profile = tmp_path / "profile.json"
    env = {**ENV, "HPCCOMM_PROFILE": str(profile)}
    cal = [MPIEXEC, "-n", "2", PY, "-m", "mpi4py", "-m", "hpccomm.bench", "calibrate", "--quick",
           "--codec", "onebit,topk", "--if-missing"]
    first = subprocess.run(cal, capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == 0 and f"wrote {profile}" in first.stdout, first.stderr
    again = subprocess.run(cal, capture_output=True, text=True, timeout=240, env=env)
    assert again.returncode == 0 and "exists" in again.stdout and "wrote" not in again.stdout
    out = tmp_path / "r.json"
    proc = subprocess.run([MPIEXEC, "-n", "2", PY, "-m", "mpi4py", "-m", "hpccomm.bench",
                           "allreduce", "-m", "4K:64K", "-f", "16", "-i", "3", "-x", "1",
                           "--codec", "onebit,topk", "--algorithm", "mpi,auto,twoshot",
                           "--order", "interleaved", "--no-progress", "-J", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "skipped" not in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    autos = [r for r in rows if r["algorithm_name"] == "auto"]
    assert len(autos) == 2 * 2 and all(r["auto_profile"] == str(profile) for r in autos)
    for r in autos:
        assert f"auto:{r['auto_choice']}" in proc.stdout
    assert f"# auto decided by: {profile}" in proc.stdout
    tail = proc.stdout.splitlines()[-2:]
    assert [line.split()[1] for line in tail] == ["onebit", "topk"]
    # a pair named by itself that cannot run is still said
    alone = bench(2, "allreduce", "-m", "4K:4K", "-i", "2", "-x", "1", "--codec", "onebit",
                  "--algorithm", "mpi", "--no-progress")
    assert alone.returncode == 0 and "# skipped onebit+mpi" in alone.stdout


def test_summary_says_where_compression_paid():
    from hpccomm.bench.allreduce import summary

    def row(size, codec, alg, t, choice=None):
        return {"size": size, "codec_name": codec, "algorithm": alg, "algorithm_name": alg,
                "time_median": t, "auto_choice": choice, "auto_profile": None}

    rows = [row(1024, "-", "MPI_Allreduce", 1.0), row(4096, "-", "MPI_Allreduce", 4.0),
            row(1024, "none", "mpi", 1.1), row(4096, "none", "mpi", 4.1),
            row(1024, "onebit", "auto", 1.02, "dense"), row(1024, "onebit", "twoshot", 2.0),
            row(4096, "onebit", "auto", 1.0, "twoshot"), row(4096, "onebit", "twoshot", 1.6),
            row(1024, "topk", "twoshot", 0.97), row(4096, "topk", "twoshot", 3.9)]
    lines = summary(rows)
    assert lines[-2] == ("#   onebit     paid at 4KiB: up to 4.00x (auto:twoshot, 4KiB); "
                         "auto sent dense at 1KiB")
    # 1.03x is within the noise: not paid
    assert lines[-1] == "#   topk       did not pay here: at best 1.03x MPI_Allreduce (twoshot, 1KiB)"


@pytest.mark.parametrize("bound", ["bounded", "unbounded"])
def test_a_short_soak_holds_nothing_more_at_the_end(tmp_path, bound):
    """3,000 calls of the soak's mix at P = 3, a new transient key every 5
    calls of a reducer: at every sample hpccomm holds its one private
    communicator and no datatype, operation or request, the files and
    threads stay as they were, and the keys kept never pass the bound (six
    reducers of at most 4 + 4 keys) -- which the run without max_keys or
    reset(key) passes, as it must."""
    out = tmp_path / "soak.json"
    extra = ["--unbounded"] if bound == "unbounded" else []
    proc = bench(3, "soak", "--calls", "3000", "--sample", "300", "--transient-every", "5",
                 "-J", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for samples in data["samples"]:
        first = samples[0]
        for s in samples:
            assert (s["comms"], s["datatypes"], s["ops"], s["requests"]) == (1, 0, 0, 0), s
            assert (s["fds"], s["threads"]) == (first["fds"], first["threads"]), s
        most = max(s["keys"] for s in samples)
        if bound == "bounded":
            assert most <= 48 and samples[-1]["rss_mib"] < 1.05 * first["rss_mib"], samples
        else:
            assert most > 100 and "soak: GROWS" in proc.stdout, samples


def test_calibrate_skips_a_call_the_algorithm_cannot_make():
    """A codec an algorithm cannot carry gets no per-call term (its call would
    raise on every rank); one it can carry gets a measured time."""
    from mpi4py import MPI

    from hpccomm.bench.calibrate import measure_call

    assert measure_call(MPI.COMM_SELF, "onebit", "no-such-algorithm", 1024, 3) is None
    assert measure_call(MPI.COMM_SELF, "onebit", "allgather", 1024, 3) > 0
