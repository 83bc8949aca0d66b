"""The suite's own machinery: which files each MPI run of tests/run.py
collects."""
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
