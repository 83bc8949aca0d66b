"""The cost model behind ``algorithm="auto"``: interpolation of the measured
patterns, the profile schema, and falling back to the defaults."""
import copy
import json

import pytest

from hpccomm import cost_model
from hpccomm.cost_model import DEFAULT, CostModel, ProfileError


def profile(**patterns):
    p = copy.deepcopy(DEFAULT)
    p["patterns"].update(patterns)
    return p


def test_patterns_interpolate_linearly_and_extrapolate_with_the_last_slope():
    m = CostModel(profile(allreduce=[[1000, 2e-3], [8, 1e-5], [2000, 3e-3]]))  # unsorted
    assert m.pattern("allreduce", 4) == 1e-5                    # below: alpha
    assert m.pattern("allreduce", 504) == pytest.approx(1e-5 + 496 * (2e-3 - 1e-5) / 992)
    assert m.pattern("allreduce", 1000) == pytest.approx(2e-3)
    assert m.pattern("allreduce", 4000) == pytest.approx(5e-3)  # slope 1e-6 per byte


def test_algorithm_predictions_add_up():
    m = CostModel(profile(alltoallv=[[0, 1.0], [10, 1.0]], allgatherv=[[0, 2.0], [10, 2.0]],
                          allreduce=[[0, 0.0], [100, 10.0]]))
    line = lambda rate: [[0, 0.0], [100, 100 * rate]]  # noqa: E731
    m._kernels["x"] = {k: cost_model._points(line(r), k)
                       for k, r in (("encode", 1.0), ("owner", 0.5), ("decode", 0.25))}
    n, P = 8, 2
    kernels = 2 * 4 * 1.0 + 4 * 0.5 + 4 * 0.25
    o = m.overhead
    assert m.dense(n) == pytest.approx(o["dense"] + 3.2)
    assert m.twoshot("x", n, P, 10) == pytest.approx(o["twoshot"] + kernels + 3.0)
    assert m.twoshot("x", n, P, 10, segments=4) == pytest.approx(
        o["twoshot"] + max(kernels, 3.0) + min(kernels, 3.0) / 4)
    assert m.allgather("x", n, P, 10) == pytest.approx(o["allgather"] + 8 + 2.0 + 2 * 8 * 0.25)


def test_waits_follow_each_compute_phase():
    """twoshot waits after its encodes and after its owner step (per segment),
    allgather after its encode; dense never."""
    p = profile(alltoallv=[[0, 1.0], [10, 1.0]], allgatherv=[[0, 2.0], [10, 2.0]])
    p["waits"] = [[0, 0.0], [100, 50.0]]          # half the phase
    m, plain = CostModel(p), CostModel(profile(alltoallv=p["patterns"]["alltoallv"],
                                               allgatherv=p["patterns"]["allgatherv"]))
    line = lambda rate: [[0, 0.0], [100, 100 * rate]]  # noqa: E731
    for model in (m, plain):
        model._kernels["x"] = {k: cost_model._points(line(r), k)
                               for k, r in (("encode", 1.0), ("owner", 0.5), ("decode", 0.25))}
    n, P = 12, 3           # chunks of 4: encodes 3 * 4, owner 2 + 1 * 1
    assert m.wait(12) == 6.0 and m.wait(0) == 0.0 and plain.wait(12) == 0.0
    got, base = m.twoshot_terms("x", n, P, 10), plain.twoshot_terms("x", n, P, 10)
    assert got["comm"] - base["comm"] == pytest.approx(6.0 + 1.5)
    assert got["kernels"] == base["kernels"]
    got, base = (m.twoshot_terms("x", n, P, 10, segments=3),
                 plain.twoshot_terms("x", n, P, 10, segments=3))
    assert got["comm"] - base["comm"] == pytest.approx(3 * (2.0 + 0.5))
    assert m.allgather("x", n, P, 10) - plain.allgather("x", n, P, 10) == pytest.approx(6.0)
    assert m.dense(n) == plain.dense(n)


def test_pipelined_twoshot_hides_the_measured_share_of_the_shorter_phase():
    """kernels 4 * 1 + 2 * 0.5 + 2 * 0.25 = 5.5 s, wire 3 s, 4 segments: full
    overlap hides 3/4 of the wire, none hides nothing, half hides half that."""
    p = profile(alltoallv=[[0, 1.0], [10, 1.0]], allgatherv=[[0, 2.0], [10, 2.0]])
    line = lambda rate: [[0, 0.0], [100, 100 * rate]]  # noqa: E731
    for share, hidden in ((1.0, 2.25), (0.0, 0.0), (0.5, 1.125)):
        m = CostModel({**copy.deepcopy(p), "overlap": share})
        m._kernels["x"] = {k: cost_model._points(line(r), k)
                           for k, r in (("encode", 1.0), ("owner", 0.5), ("decode", 0.25))}
        o = m.overhead["twoshot"]
        assert m.twoshot("x", 4, 2, 10, segments=4) == pytest.approx(o + 5.5 + 3.0 - hidden)
        assert m.twoshot("x", 4, 2, 10) == pytest.approx(o + 5.5 + 3.0)


def test_kernels_interpolate_and_fall_back():
    p = copy.deepcopy(DEFAULT)
    p["kernels"]["c"] = {"encode": [[100, 2e-6], [1100, 12e-6]], "owner": [[100, 3e-6]],
                         "decode": [[100, 1e-6], [1100, 0.5e-6]]}
    m = CostModel(p)
    assert m.kernel("c", "encode", 600) == pytest.approx(7e-6)
    assert m.kernel("c", "owner", 10**6) == pytest.approx(3e-6)      # one point: constant
    assert m.kernel("c", "decode", 10**6) >= 0                        # never negative
    assert m.kernel("other", "encode", 4096) == m.kernel("*", "encode", 4096)


@pytest.mark.parametrize("bad,match", [
    ({"format": 3}, "format 1 or 2"),
    ({**DEFAULT, "patterns": {"allreduce": [[8, 1e-6]]}}, "needs the patterns"),
    (profile(alltoallv=[[8, float("nan")]]), "bad point"),
    ({**DEFAULT, "kernels": {"onebit": {"encode": [[1, 2]]}}}, "kernel costs of 'onebit'"),
    ({**DEFAULT, "kernels": {"onebit": {k: [[1, -2]] for k in ("encode", "owner", "decode")}}},
     "bad point"),
    ({**DEFAULT, "overhead": {"dense": 1e-6}}, "overhead"),
    ({**DEFAULT, "oversubscription": 0.5}, "oversubscription"),
    ({**DEFAULT, "calls": {"onebit": {"mpi": 1e-6}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": float("nan")}}}, "calls"),
    ({**DEFAULT, "calls": ["onebit"]}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": []}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": [[4096, 1e-6], [1024, 2e-6]]}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": [[0, 1e-6]]}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": [[1024, float("inf")]]}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": [[1024, 1e-6, 3]]}}}, "calls"),
    ({**DEFAULT, "calls": {"onebit": {"twoshot": True}}}, "calls"),
    ({**DEFAULT, "waits": [[1e-3, -1.0]]}, "bad point"),
    ({**DEFAULT, "overlap": 1.5}, "overlap"),
])
def test_schema_errors(bad, match):
    with pytest.raises(ProfileError, match=match):
        cost_model.validate(bad)


def test_load_save_and_fallback(tmp_path):
    path = tmp_path / "sub" / "p.json"
    p = profile(allreduce=[[8, 1.0], [16, 2.0]])
    cost_model.save(p, str(path))
    got, source = cost_model.load(str(path))
    assert got == json.loads(json.dumps(p)) and source == str(path)
    assert cost_model.load(str(tmp_path / "none.json")) == (DEFAULT, "defaults")
    path.write_text("[1, 2")
    with pytest.warns(RuntimeWarning, match="ignoring the profile"):
        got, source = cost_model.load(str(path))
    assert source == "defaults" and got == DEFAULT


def test_profile_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCCOMM_PROFILE", "/x/y.json")
    assert cost_model.profile_path("abc", 4) == "/x/y.json"
    monkeypatch.delenv("HPCCOMM_PROFILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_model.profile_path("abc", 4) == str(tmp_path / "hpccomm" / "profile-abc-P4.json")


def test_kernels_are_scaled_by_the_ranks_per_core_in_format_1_only():
    base = CostModel(copy.deepcopy(DEFAULT))
    old = CostModel({**copy.deepcopy(DEFAULT), "format": 1, "oversubscription": 2.0})
    new = CostModel({**copy.deepcopy(DEFAULT), "oversubscription": 2.0})
    assert old.kernel("x", "encode", 1 << 20) == pytest.approx(
        2 * base.kernel("x", "encode", 1 << 20))
    assert new.kernel("x", "encode", 1 << 20) == base.kernel("x", "encode", 1 << 20)
    assert old.pattern("allreduce", 4096) == base.pattern("allreduce", 4096)


def test_a_codecs_calls_replace_the_algorithms_overhead():
    p = copy.deepcopy(DEFAULT)
    p["calls"] = {"onebit": {"twoshot": 1.0}}
    m, base = CostModel(p), CostModel(copy.deepcopy(DEFAULT))
    assert m.call_overhead("onebit", "twoshot") == 1.0
    assert m.call_overhead("onebit", "allgather") == DEFAULT["overhead"]["allgather"]
    assert m.call_overhead("topk", "twoshot") == DEFAULT["overhead"]["twoshot"]
    assert m.twoshot("onebit", 4096, 2, 100) == pytest.approx(
        base.twoshot("onebit", 4096, 2, 100) - DEFAULT["overhead"]["twoshot"] + 1.0)
    assert m.twoshot("topk", 4096, 2, 100) == base.twoshot("topk", 4096, 2, 100)


def test_a_ladder_of_call_terms_follows_the_size():
    """``calls`` as ``[[n, seconds], ...]``: signed, linear in ``n`` between
    the points and held beyond both ends; each algorithm's terms read it at
    the call's ``n``."""
    p = copy.deepcopy(DEFAULT)
    ladder = [[1024, -4e-5], [4096, -1e-4], [65536, 2e-5]]
    p["calls"] = {"topk": {"twoshot": ladder, "allgather": 3e-5}}
    m = CostModel(p)
    assert m.call_overhead("topk", "twoshot", 16) == -4e-5
    assert m.call_overhead("topk", "twoshot", 1024) == -4e-5
    assert m.call_overhead("topk", "twoshot", 2560) == pytest.approx(-7e-5)
    assert m.call_overhead("topk", "twoshot", 4096) == -1e-4
    assert m.call_overhead("topk", "twoshot", 34816) == pytest.approx(-4e-5)
    assert m.call_overhead("topk", "twoshot", 1 << 26) == 2e-5
    assert m.call_overhead("topk", "allgather", 1 << 26) == 3e-5
    assert m.twoshot_terms("topk", 34816, 2, 600)["overhead"] == pytest.approx(-4e-5)
    assert m.twoshot_terms("topk", 1 << 20, 2, 600)["overhead"] == 2e-5
    assert m.allgather_terms("topk", 4096, 2, 600)["overhead"] == 3e-5
    assert cost_model.validate(copy.deepcopy(p)) == p


def test_a_negative_call_term_takes_back_at_most_the_kernels():
    """A planned call that skips Python the kernel terms hold has a negative
    per-call term: it lowers the prediction by itself, and never below the
    call's time in MPI."""
    p = copy.deepcopy(DEFAULT)
    p["calls"] = {"onebit": {"twoshot": -5e-6, "allgather": -1.0}}
    m, base = CostModel(p), CostModel(copy.deepcopy(DEFAULT))
    got, ref = m.twoshot_terms("onebit", 4096, 2, 600), base.twoshot_terms("onebit", 4096, 2, 600)
    assert got["overhead"] == -5e-6 and got["kernels"] == ref["kernels"] > 5e-6
    assert m.twoshot("onebit", 4096, 2, 600) == pytest.approx(sum(ref.values())
                                                              - ref["overhead"] - 5e-6)
    terms = m.allgather_terms("onebit", 4096, 2, 600)
    assert terms["overhead"] == -terms["kernels"] < 0
    assert m.allgather("onebit", 4096, 2, 600) == pytest.approx(terms["comm"])


@pytest.mark.parametrize("algorithm", ["dense", "mpi", "MPI_Allreduce", "twoshot", "allgather"])
@pytest.mark.parametrize("segments", [1, 4])
def test_terms_add_up_to_the_prediction(algorithm, segments):
    import hpccomm

    m = CostModel(copy.deepcopy(DEFAULT))
    codec = hpccomm.get_codec("onebit")
    n, P = 1 << 22, 3
    terms = cost_model.predict_terms(m, codec, algorithm, n, P, (n,), segments)
    assert set(terms) == {"overhead", "kernels", "comm"}
    assert all(v >= 0 for v in terms.values())
    assert cost_model.predict(m, codec, algorithm, n, P, (n,), segments) == sum(terms.values())
    if algorithm == "MPI_Allreduce":     # the bare call: no reducer around it
        assert terms == {"overhead": 0.0, "kernels": 0.0, "comm": m.pattern("allreduce", 4 * n)}
