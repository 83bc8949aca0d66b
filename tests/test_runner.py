"""The suite's own machinery: which files each run of tests/run.py collects,
and when tests/gpu.py skips the GPU tests without importing numba.cuda."""
import json
import sys

import pytest

from tests import gpu, run
from tests.conftest import pytest_collection_modifyitems
from tests.run import NARROW, paths_for, run_markers, selection

#: a marker map as tests/conftest.py writes it: each file's distinct marker sets
FILES = {
    "mixed.py": [{"mpi"}, {"mpi", "narrow"}],
    "narrow.py": [{"mpi", "narrow", "parametrize"}],
    "slow.py": [{"mpi", "slow"}, {"mpi", "narrow"}],
    "split.py": [{"mpi", "cudasim"}, {"mpi", "wide"}],
    "alone.py": [{"alone"}, set()],
    "plain.py": [set(), {"parametrize"}],
}


def test_a_run_collects_the_files_that_hold_a_test_it_selects():
    # beyond NARROW ranks: a file whose tests are all narrow is not imported
    assert paths_for(FILES, ["mpi"], ["slow", "cudasim", "narrow"]) == ["mixed.py", "split.py"]
    assert paths_for(FILES, ["mpi"], ["slow", "cudasim"]) == ["mixed.py", "narrow.py",
                                                              "slow.py", "split.py"]
    # a file with a narrow and a slow test, neither of which the slow run excludes
    assert paths_for(FILES, ["mpi", "slow"]) == ["slow.py"]
    # every required marker on one test, not spread over two
    assert paths_for(FILES, ["mpi", "cudasim", "wide"], ["slow"]) == []
    assert paths_for(FILES, ["alone"], ["mpi"]) == ["alone.py"]
    assert paths_for(None, ["mpi"]) == ["tests"]


def test_each_run_selects_what_it_always_selected():
    expressions = {
        ("plain", 1): "not mpi and not alone",
        ("alone", 1): "alone and not mpi",
        ("mpi", NARROW): "mpi and not slow and not cudasim",
        ("mpi", NARROW + 1): "mpi and not slow and not cudasim and not narrow",
        ("cudasim", 4): "mpi and cudasim and not slow",
        ("cudasim", 5): "mpi and cudasim and wide and not slow",
        ("wide", 8): "mpi and wide and not slow",
        ("slow", 2): "mpi and slow",
    }
    assert {key: selection(*run_markers(*key)) for key in expressions} == expressions
    with pytest.raises(ValueError):
        run_markers("nosuch")


class _Mark:
    def __init__(self, name):
        self.name = name


class _Item:
    def __init__(self, nodeid, *marks, defined_in="tests/helpers.py"):
        self.nodeid, self.location = nodeid, (defined_in, 0, nodeid)
        self._marks = [_Mark(m) for m in marks]

    def iter_markers(self):
        return iter(self._marks)


class _Session:
    testsfailed = 0


def test_the_map_the_plain_run_writes_is_the_map_the_mpi_runs_read(tmp_path, monkeypatch):
    path = tmp_path / "markers.json"
    monkeypatch.setenv("HPCCOMM_TEST_MARKERS", str(path))
    monkeypatch.setattr(run, "MARKERS", str(path))
    items = [_Item("tests/test_a_mpi.py::test_x[1]", "mpi", "parametrize"),
             _Item("tests/test_a_mpi.py::test_x[2]", "mpi", "parametrize"),
             _Item("tests/test_a_mpi.py::test_y", "mpi", "narrow"),
             _Item("tests/test_b.py::test_z")]
    pytest_collection_modifyitems(_Session(), items)
    # filed under the module that collected each test, not where it is defined
    assert run.files_by_marker(None, None) == {
        "tests/test_a_mpi.py": [{"mpi", "narrow"}, {"mpi", "parametrize"}],
        "tests/test_b.py": [set()]}
    # a map of another shape (flat name lists) is refused, not misread
    path.write_text(json.dumps({"tests/test_a_mpi.py": ["mpi", "narrow"]}))
    assert run.files_by_marker(None, None) is None


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


def test_the_simulator_runs_without_a_driver(monkeypatch):
    monkeypatch.setattr(gpu, "_no_driver", lambda: True)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert gpu._skip_before_numba() is None
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    assert "no CUDA driver" in gpu._skip_before_numba()
    monkeypatch.setattr(gpu, "_no_driver", lambda: False)
    assert gpu._skip_before_numba() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the list is Linux's")
def test_the_driver_list_is_numbas():
    driver = pytest.importorskip("numba.cuda.cudadrv.driver")
    assert set(gpu.LINUX_DRIVERS) == set(driver.locate_driver_and_loader()[1])
