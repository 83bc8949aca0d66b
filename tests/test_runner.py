"""The suite's own machinery: which files each MPI run of tests/run.py
collects, and when tests/gpu.py skips the GPU tests without importing
numba.cuda."""
import sys

import pytest

from tests import gpu
from tests.run import paths_for, selection

#: a marker map as tests/conftest.py writes it: each file's distinct marker sets
FILES = {
    "mixed.py": [{"mpi"}, {"mpi", "narrow"}],
    "narrow.py": [{"mpi", "narrow", "parametrize"}],
    "slow.py": [{"mpi", "slow"}, {"mpi", "narrow"}],
    "alone.py": [{"alone"}, set()],
    "plain.py": [set(), {"parametrize"}],
}


def test_a_run_collects_the_files_that_hold_a_test_it_selects():
    # beyond NARROW ranks: a file whose tests are all narrow is not imported
    assert paths_for(FILES, ["mpi"], ["slow", "cudasim", "narrow"]) == ["mixed.py"]
    assert paths_for(FILES, ["mpi"], ["slow", "cudasim"]) == ["mixed.py", "narrow.py",
                                                              "slow.py"]
    # a file with a narrow and a slow test, neither of which the slow run excludes
    assert paths_for(FILES, ["mpi", "slow"]) == ["slow.py"]
    assert paths_for(FILES, ["alone"], ["mpi"]) == ["alone.py"]
    assert paths_for(None, ["mpi"]) == ["tests"]


def test_the_expression_is_built_from_the_same_markers():
    assert selection(["mpi"], ["slow", "narrow"]) == "mpi and not slow and not narrow"
    assert selection(["mpi", "cudasim", "wide"]) == "mpi and cudasim and wide"
    assert selection([], ["mpi", "alone"]) == "not mpi and not alone"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check is Linux's")
def test_no_driver_only_where_no_library_numba_tries_loads(monkeypatch):
    monkeypatch.delenv("NUMBA_CUDA_DRIVER", raising=False)
    monkeypatch.delenv("HPCCOMM_GPU_CHECK", raising=False)
    monkeypatch.setattr(gpu, "LINUX_DRIVERS", ("libhpccomm-no-such-driver.so",))
    assert gpu._no_driver()
    # any library that loads stands for a driver found
    monkeypatch.setattr(gpu, "LINUX_DRIVERS", ("libhpccomm-no-such-driver.so", "libc.so.6"))
    assert not gpu._no_driver()
    monkeypatch.setattr(gpu, "LINUX_DRIVERS", ("libhpccomm-no-such-driver.so",))
    # a driver named to numba, or ./dev.sh gpu: numba.cuda decides
    monkeypatch.setenv("NUMBA_CUDA_DRIVER", "/opt/driver/libcuda.so")
    assert not gpu._no_driver()
    monkeypatch.delenv("NUMBA_CUDA_DRIVER")
    monkeypatch.setenv("HPCCOMM_GPU_CHECK", "1")
    assert not gpu._no_driver()
