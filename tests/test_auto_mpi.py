"""``algorithm="auto"`` under MPI: the same decision on every rank (rank 0's
profile rules), a corrupt profile warns and falls back to the defaults, the
per-key policy overrides the model, and the result has the bits of the
algorithm chosen."""
import copy
import json
import warnings

import numpy as np
import pytest

import hpccomm
from hpccomm import cost_model

from .helpers import COMM, RANK, SIZE, digest, same_on_all_ranks

pytestmark = pytest.mark.mpi


def slow_network_profile():
    """A profile in which a dense allreduce costs 1 s per 4 MiB and packets
    are nearly free: compression pays from a few thousand elements."""
    p = copy.deepcopy(cost_model.DEFAULT)
    p["patterns"]["allreduce"] = [[8, 1e-4], [1 << 22, 1.0]]
    p["patterns"]["alltoallv"] = [[8, 1e-6], [1 << 22, 1e-3]]
    p["patterns"]["allgatherv"] = [[8, 1e-6], [1 << 22, 1e-3]]
    fast = [[8, 1e-6], [1 << 24, 1e-3]]
    p["kernels"] = {"*": {"encode": fast, "owner": fast, "decode": fast}}
    p["overhead"] = {"dense": 1e-6, "twoshot": 1e-6, "allgather": 1e-6}
    return p


def write(path, profile):
    path.write_text(json.dumps(profile) if isinstance(profile, dict) else profile)
    return str(path)


def run(reducer, n, key="g", steps=2):
    outs = []
    for step in range(steps):
        x = np.random.default_rng([step, RANK, n]).standard_normal(n).astype(np.float32)
        outs.append(digest(reducer(x, key=key)))
    return outs


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["onebit", "qsgd", "topk"])
def test_rank_zeros_profile_decides_everywhere_with_the_chosen_bits(codec, tmp_path,
                                                                    monkeypatch):
    """Rank 0 reads a slow-network profile, the others none at all (the
    defaults would send dense): every rank compresses, and the results have
    the bits of the chosen algorithm called directly."""
    if RANK == 0:
        monkeypatch.setenv("HPCCOMM_PROFILE", write(tmp_path / "p.json", slow_network_profile()))
    else:
        monkeypatch.setenv("HPCCOMM_PROFILE", str(tmp_path / "missing.json"))
    n = 5000
    auto = hpccomm.Allreducer(COMM, codec=codec, algorithm="auto", seed=3)
    got = run(auto, n)
    choice = auto.stats.last.extra["auto"]
    choices = COMM.allgather(choice)
    direct = run(hpccomm.Allreducer(COMM, codec=codec, algorithm=choice, seed=3), n)
    assert len(set(choices)) == 1 and choice != "dense", choices
    assert same_on_all_ranks(np.frombuffer("".join(got).encode(), np.uint8))
    assert got == direct


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
def test_a_repeated_compressed_choice_takes_the_algorithms_plan(codec, tmp_path, monkeypatch):
    """A key that ``auto`` sends through ``twoshot`` repeats through
    twoshot's plan, as twoshot called directly does: the same bits, residuals
    and bytes, and the choice still in the statistics."""
    p = slow_network_profile()        # decodes that cost: twoshot decodes less than allgather
    p["kernels"]["*"]["decode"] = [[8, 1e-6], [1 << 24, 3.4]]    # 0.2 us per element
    monkeypatch.setenv("HPCCOMM_PROFILE", write(tmp_path / "p.json", p))
    n = 5000
    auto = hpccomm.Allreducer(COMM, codec=codec, algorithm="auto", seed=3)
    direct = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", seed=3)
    assert run(auto, n, steps=4) == run(direct, n, steps=4)
    assert auto.stats.last.extra["auto"] == "twoshot"
    assert auto.repeat_path("g") == direct.repeat_path("g") != None  # noqa: E711
    last, ref = auto.stats.last, direct.stats.last     # (auto's first call bcasts the profile)
    assert (last.bytes_sent, last.bytes_recv) == (ref.bytes_sent, ref.bytes_recv)
    assert ({k: digest(v) for k, v in auto.state_dict()["keys"]["g"]["residuals"].items()}
            == {k: digest(v) for k, v in direct.state_dict()["keys"]["g"]["residuals"].items()})


def test_defaults_send_dense_and_keep_the_residual():
    """Without a profile (the defaults of a shared-memory machine) auto sends
    dense: the exact float32 sum, and error feedback's residual untouched."""
    auto = hpccomm.Allreducer(COMM, codec="onebit", algorithm="auto", error_feedback=True)
    x = np.arange(1000, dtype=np.float32) * np.float32(RANK + 1)
    res = auto(x, key="w")
    assert auto.stats.last.extra["auto"] == "dense"
    np.testing.assert_array_equal(res, np.arange(1000, dtype=np.float32)
                                  * np.float32(SIZE * (SIZE + 1) // 2))
    assert "worker" not in auto.state_dict()["keys"]["w"]["residuals"]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1}),
                                     json.dumps({**cost_model.DEFAULT, "overhead": {"dense": -1}})])
def test_a_corrupt_profile_warns_and_falls_back(content, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCCOMM_PROFILE", write(tmp_path / "bad.json", content))
    auto = hpccomm.Allreducer(COMM, codec="onebit", algorithm="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto(np.ones(100, np.float32), key="k")
    warned = any("ignoring the profile" in str(w.message) for w in caught)
    assert auto.algorithm.source == "defaults"
    assert warned or RANK != 0      # only rank 0 reads the file


def test_policy_overrides_the_model_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCCOMM_PROFILE", str(tmp_path / "missing.json"))
    auto = hpccomm.Allreducer(COMM, codec="fp16", algorithm="auto",
                              policy={"fc.*": "twoshot", "emb": "allgather"})
    x = np.ones(64, np.float32)
    seen = {}
    for key in ("fc.weight", "emb", "conv"):
        auto(x, key=key)
        seen[key] = auto.stats.last.extra["auto"]
    assert seen == {"fc.weight": "twoshot", "emb": "allgather", "conv": "dense"}


def test_bad_policy_is_raised_everywhere():
    from .helpers import raise_everywhere

    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.ones(4, np.float32), codec="onebit", algorithm="auto",
                                  policy={"x": "fastest"}))
    assert name == "ValueError" and "policy maps key patterns" in message and agreed


@pytest.mark.skipif(SIZE == 1, reason="no time inside MPI at one rank")
def test_calibrated_call_term_leaves_the_time_inside_mpi_out():
    """The per-call term is a call's time outside MPI: for a dense call of
    4 MiB, whose time is nearly all the ``MPI_Allreduce``, a small part of
    the whole call timed the same way."""
    from hpccomm.bench.calibrate import measure_call
    from hpccomm.bench.harness import slowest_median

    n = 1 << 20
    outside = measure_call(COMM, "none", "mpi", n, 5)
    x = np.ones(n, np.float32)
    out = np.empty_like(x)
    r = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi", check="first")
    whole = slowest_median(COMM, lambda: r(x, key="k", out=out), 20)
    assert 0 < outside < 0.1 * whole, (outside, whole)
