"""Errors inside a collective end the job on every rank (``on_error="abort"``,
:mod:`hpccomm.failstop`), for every algorithm, at P = 2, 3 and 5: a real
``mpiexec`` job per case (``tests/faults.py``), where rank 1 is hit on its
third call -- a packet header corrupted in flight (the decoder refuses it) or
an exception right after a transfer -- at the call's first transfer (the
owner's input) or its last (the final decode's), on host memory and through
the device twins under numba's CUDA simulator.  Every rank catches what its
call raises and walks on to a closing barrier, so without the fail-stop the
other ranks wait in the call forever: each case is killed after
:data:`LIMIT` seconds and fails.

Each case is a job of its own (an abort ends it), 1-3 s: the suite runs
every algorithm at P = 3 (once where a call makes one transfer:
:data:`ONE_TRANSFER`) and :data:`EVERY_P` at 2, 3 and 5;
``HPCCOMM_FAULTS=all`` runs every algorithm at every P (84 jobs)::

    HPCCOMM_FAULTS=all python -m pytest -q -n 2 tests/test_faults.py
"""
import os
import re

import pytest

from .faults import CASES, run_job

#: seconds a job may take to end (a hang fails here)
LIMIT = 30

#: algorithms whose packets a decoder can refuse; the others move plain
#: numbers (``MPI_Allreduce`` sums, kylix's values once routed), where a
#: flipped byte is a wrong number no receiver can tell, so an exception is
#: injected instead
CORRUPTIBLE = {"twoshot", "allgather", "hierarchical", "oktopk", "rle_pipeline",
               "sparse_allgather", "sparse_op", "sparse_rd", "sparse_split"}


def _expect_abort(job, ranks, error, thread=""):
    assert not job.timed_out, f"hung: {job}"
    assert job.rc != 0, job
    assert f"hpccomm: rank 1 of {ranks}{thread}: {error} inside a collective" in job.output, job
    assert "MPI_Abort" in job.output, job
    assert "finished" not in job.output, job      # no rank got past the call
    assert job.seconds < LIMIT, job


#: algorithms whose call at P = 3 makes one transfer (one that brings packets,
#: for the corruptible ones): there the first transfer is the last, and the
#: ``last`` job would repeat the ``first`` one.  The ``first`` job checks the
#: claim from the counts rank 1 prints before it is hit.
ONE_TRANSFER = {"allgather", "auto", "mpi", "sparse_allgather", "sparse_op"}


#: the algorithms the suite tries at every P (the rest at P = 3)
EVERY_P = {"twoshot", "sparse_split"}
ALL = os.environ.get("HPCCOMM_FAULTS") == "all"


@pytest.mark.parametrize("ranks", [2, 3, 5])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_an_error_on_one_rank_inside_a_call_ends_the_job(algorithm, where, ranks):
    if ranks != 3 and algorithm not in EVERY_P and not ALL:
        pytest.skip("at P = 3 only (HPCCOMM_FAULTS=all: every P)")
    one = ranks == 3 and algorithm in ONE_TRANSFER
    if one and where == "last" and not ALL:
        pytest.skip("one transfer a call at P = 3: the first job hits it")
    kind = "corrupt" if algorithm in CORRUPTIBLE else "raise"
    job = run_job(ranks, ["error", algorithm, where, kind], timeout=LIMIT + 15)
    _expect_abort(job, ranks, "PacketError" if kind == "corrupt" else "RuntimeError")
    if one:
        m = re.search(r"rank 1: call 2 made (\d+) transfers of the kind hit", job.output)
        assert m, job
        assert int(m.group(1)) == 1, \
            f"{algorithm} no longer makes one transfer a call: take it out of ONE_TRANSFER"


@pytest.mark.parametrize("ranks", [3, 5])
def test_a_corrupted_index_message_of_kylix_routing_ends_the_job(ranks):
    """kylix's first call routes: index sets travel, and one corrupted in
    flight is refused before its union is scattered from."""
    job = run_job(ranks, ["error", "kylix", "first", "corrupt", "--step", 0], timeout=LIMIT + 15)
    _expect_abort(job, ranks, "PacketError")
    assert "kylix: index message" in job.output, job


@pytest.mark.parametrize("ranks,algorithm,where,kind", [
    (3, "twoshot", "first", "corrupt"), (2, "allgather", "last", "corrupt"),
    (5, "twoshot", "last", "raise")])
def test_a_device_twin_error_on_one_rank_ends_the_job(ranks, algorithm, where, kind):
    job = run_job(ranks, ["error", algorithm, where, kind, "--device"], timeout=LIMIT + 30,
                  simulator=True)
    _expect_abort(job, ranks, "PacketError" if kind == "corrupt" else "RuntimeError")


@pytest.mark.parametrize("where", ["first", "last"])
def test_an_error_on_the_progress_thread_ends_the_job(where):
    """The same through ``start()``: the progress thread meets the error
    and stops the job from there."""
    job = run_job(3, ["error", "twoshot", where, "corrupt", "--started"], timeout=LIMIT + 15)
    _expect_abort(job, 3, "PacketError", thread=" (thread hpccomm-progress)")


def test_on_error_raise_leaves_the_error_on_its_rank():
    """``on_error="raise"``: rank 1 raises, alone; the job would hang (so the
    default's abort is what ends it), and is stopped 2 s after rank 1 says it
    raised -- an abort, which follows the error at once, would show by then."""
    job = run_job(3, ["error", "twoshot", "first", "corrupt", "--raise"], timeout=LIMIT,
                  until="rank 1: call 3 raised", grace=2)
    assert job.timed_out and job.seconds < LIMIT, job
    assert "rank 1: call 3 raised PacketError" in job.output, job
    assert "MPI_Abort" not in job.output, job


# ---------------------------------------------------------------------------
# faults at P = 3: a rank killed, a rank stalled, MPI finalized under started calls
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["started", "thread"])
def test_a_rank_killed_with_a_started_call_ends_the_job(when):
    """SIGKILL of rank 1 right after ``start()`` or while its progress thread
    is inside the call's collective: ``mpiexec`` sees the death and ends the
    others, which wait in ``wait()`` (nothing of hpccomm's keeps them)."""
    job = run_job(3, ["kill", when], timeout=LIMIT + 15)
    assert not job.timed_out, f"hung: {job}"
    assert job.rc != 0 and "rank 1: killing itself" in job.output, job
    assert "finished" not in job.output, job
    assert job.seconds < LIMIT, job


#: how long the stalled rank sleeps: far beyond any wait of a call (a few ms;
#: hpccomm's waits have no time limit), and short, since the waiting ranks
#: poll both cores for all of it
STALL = 2


def test_a_stalled_rank_finishes_late_with_the_same_results():
    """Rank 1 sleeps 2 s before its second call while the others' progress
    threads wait inside it: every rank's run lasts the stall at least, no
    rank raises, and every result equals the same calls' without the stall,
    bit for bit, on every rank."""
    job = run_job(3, ["stall", STALL], timeout=STALL + LIMIT + 20)
    assert not job.timed_out and job.rc == 0, job
    took = [float(t) for t in re.findall(r"stalled run took ([\d.]+) s", job.output)]
    assert len(took) == 3 and min(took) >= STALL, job
    assert job.output.count("results the same as without the stall, on every rank") == 3, job
    assert job.output.count("finished") == 3, job


@pytest.mark.parametrize("how", ["atexit", "explicit"])
def test_mpi_finalize_with_calls_started_waits_for_them(how):
    """Every rank leaves four started calls unwaited; the program ends, or
    calls ``MPI.Finalize()`` itself: finalization waits for the calls (the
    explicit one crashed with glibc's ``double free`` before), exit 0."""
    job = run_job(3, ["finalize", how], timeout=LIMIT + 15)
    assert not job.timed_out and job.rc == 0, job
    assert job.seconds < LIMIT, job
    if how == "explicit":
        assert job.output.count("finalized, 4 of 4 done") == 3, job
    for bad in ("double free", "corrupted", "Segmentation", "Aborted", "Traceback"):
        assert bad not in job.output, job
