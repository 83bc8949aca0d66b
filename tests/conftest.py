"""Test configuration.  MPI tests carry ``@pytest.mark.mpi`` (pytest-mpi) and
run under ``mpiexec ... pytest --with-mpi``; see tests/run.py."""
