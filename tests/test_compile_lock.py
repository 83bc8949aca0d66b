"""``HPCCOMM_COMPILE_LOCK=1``: processes that start together on an empty
numba cache compile each kernel signature once between them
(:mod:`hpccomm.kernels.compile_lock`).

Three processes wait at a file barrier, then each runs the same onebit
encode and owner step; each reports the kernel signatures it compiled (numba's
cache misses).  Without the lock, two or three of them compile the same
signatures at once."""
import json
import os
import subprocess
import sys
import time

import pytest

CHILD = r'''
import json, os, sys, time
import numpy as np
import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.collectives.transport import Received
from hpccomm.kernels import compile_lock

barrier, me, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4:] == ["idle"]:
    print(json.dumps({"installed": compile_lock.installed()}))
    sys.exit(0)
open(os.path.join(barrier, f"ready-{me}"), "w").close()
deadline = time.time() + 60
while len([f for f in os.listdir(barrier) if f.startswith("ready-")]) < nproc:
    if time.time() > deadline:
        sys.exit("barrier timed out")
    time.sleep(0.005)

n = 3 * 4096 + 5
x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
codec = hpccomm.get_codec("onebit")
ctx = EncodeContext(seed=3, shape=(n,))
packets = [codec.encode(x * np.float32(k + 1), ctx) for k in range(3)]
sizes = [p.size for p in packets]
got = Received(np.concatenate(packets), sizes, [sum(sizes[:k]) for k in range(3)])
out = np.empty(n, np.float32)
codec.owner_step(got, None, np.zeros(n, np.float32), out, ctx)

missed = []
for name, module in sorted(sys.modules.items()):
    if not name.startswith("hpccomm.kernels.") or module is None:
        continue
    for attr, disp in sorted(vars(module).items()):
        stats = getattr(disp, "stats", None)
        if getattr(disp, "py_func", None) is None or stats is None:
            continue
        for sig, count in stats.cache_misses.items():
            missed += [f"{name}.{attr}{sig}"] * count
print(json.dumps({"installed": compile_lock.installed(), "missed": missed,
                  "out": out.tobytes().hex()}))
'''


def _run_together(tmp_path, lock: str, nproc: int = 3, *extra, timeout=200):
    barrier = tmp_path / f"barrier-{len(list(tmp_path.glob('barrier-*')))}"
    barrier.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "HPCCOMM_COMPILE_LOCK": lock, "NUMBA_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(barrier), str(k), str(nproc),
                               *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
             for k in range(nproc)]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return reports


def test_processes_starting_together_compile_each_kernel_once(tmp_path):
    t0 = time.time()
    reports = _run_together(tmp_path, "1")
    assert all(r["installed"] for r in reports)
    missed = [sig for r in reports for sig in r["missed"]]
    assert missed, "nothing was compiled: the cache was not empty"
    twice = sorted({sig for sig in missed if missed.count(sig) > 1})
    assert not twice, f"compiled by more than one process: {twice}"
    # the processes that waited loaded what the first compiled: the same bits
    assert len({r["out"] for r in reports}) == 1
    # each kernel's lock file sits beside its cache files
    locks = [name for _, _, files in os.walk(tmp_path / "cache") for name in files
             if name.endswith(".lock")]
    owner = [os.path.join(d, name) for d, _, files in os.walk(tmp_path / "cache")
             for name in files if name.startswith("hpccomm.kernels.onebit.onebit_owner_step-")
             and name.endswith(".lock")]
    assert len(owner) == 1, locks
    print(f"{len(missed)} signatures compiled once, in {time.time() - t0:.1f} s")
    # a cached kernel loads without its lock: held here, it does not stop a process
    import fcntl

    with open(owner[0], "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        again = _run_together(tmp_path, "1", 1, timeout=60)[0]
    assert again["missed"] == [] and again["out"] == reports[0]["out"]


@pytest.mark.parametrize("value", ["", "0"])
def test_the_lock_is_off_unless_asked_for(tmp_path, value):
    assert _run_together(tmp_path, value, 1, "idle")[0]["installed"] is False


def test_a_lock_that_cannot_be_taken_compiles_unlocked(tmp_path, monkeypatch):
    """A file system that refuses locks (``flock`` raising OSError) leaves the
    compile to go on unlocked, in this process."""
    import fcntl

    import numpy as np

    from hpccomm.kernels import compile_lock

    def refuse(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    path = str(tmp_path / "k.lock")
    ran = []
    with compile_lock._locked(path):
        ran.append(np.int64(1))
        with compile_lock._locked(path):      # re-entered by a callee: not taken twice
            ran.append(np.int64(2))
    assert ran == [1, 2] and not compile_lock._held


def test_the_runners_warm_up_covers_every_built_in_codec():
    """``tests/run.py`` compiles the built-in codecs before the tests from a
    list of its own (ordered by compile cost): a codec added to the registry
    and not to the list would compile in the tests again."""
    import hpccomm
    from tests.run import WARM_CODECS

    built_in = {c for c in hpccomm.available_codecs() if not c.startswith("test-")}
    assert sorted(WARM_CODECS) == sorted(built_in)
