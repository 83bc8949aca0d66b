"""Test configuration.  MPI tests carry ``@pytest.mark.mpi`` (pytest-mpi) and
run under ``mpiexec ... pytest --with-mpi``; tests also marked ``wide`` run at
4, 6 and 8 ranks as well, those marked ``narrow`` at no more than 3.  See
tests/run.py.  Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the
harness of ``tests/cudasim.py`` is installed first, so that the simulator
binds kernels, exposes arrays and takes streams as a GPU does.

With ``HPCCOMM_TEST_MARKERS=PATH`` (set by tests/run.py for its run of the
tests that need no MPI, which collects every file, or for a ``--collect-only``
pass), each test file's distinct sets of marker names (one per test, selected
or not) are written to PATH as JSON, so that each MPI run collects only the
files that hold a test its ``-m`` selects."""
import json
import os

import pytest


def pytest_configure(config):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from tests.cudasim import install

        install()
    config.addinivalue_line("markers", "wide: MPI test that also runs at 4, 6 and 8 ranks")
    config.addinivalue_line("markers", "narrow: MPI test of a layer above the collectives (fusion, "
                            "overlap, staleness, requests, the optimizers, the DDP hook, the "
                            "PyTorch helper, buffer adapters, error feedback's convergence, "
                            "the mutants, the documented examples), whose "
                            "collectives the other tests run at every rank count: at no more than "
                            "tests/run.py's NARROW ranks")
    config.addinivalue_line("markers", "slow: MPI test run once, at 2 ranks (large memory)")
    config.addinivalue_line("markers", "alone: test whose timeouts a loaded machine trips (daemons, "
                            "network namespaces): tests/run.py runs it after the other plain "
                            "tests, which run on every core, with only the MPI runs at one rank "
                            "beside it")
    config.addinivalue_line("markers", "gpu: needs a real NVIDIA GPU (numba.cuda finds one); skips "
                            "without")
    config.addinivalue_line("markers", "cudasim: MPI test of the device path, run under numba's "
                            "CUDA simulator (NUMBA_ENABLE_CUDASIM=1) at 1 and 3 ranks (and at 5 "
                            "when also marked wide)")


@pytest.hookimpl(tryfirst=True)     # before ``-m`` deselects
def pytest_collection_modifyitems(session, items):
    path = os.environ.get("HPCCOMM_TEST_MARKERS")
    if not path or session.testsfailed:         # a file that failed to collect: no map
        return
    marks = {}
    for item in items:
        # the file that collected the test (location[0] is where it is defined)
        marks.setdefault(item.nodeid.split("::", 1)[0], set()).add(
            tuple(sorted({m.name for m in item.iter_markers()})))
    part = f"{path}.{os.getpid()}.part"      # each xdist worker writes the same map
    with open(part, "w", encoding="utf-8") as f:
        json.dump({name: sorted(sets) for name, sets in sorted(marks.items())}, f, indent=0)
    os.replace(part, path)
