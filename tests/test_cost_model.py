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
    m = CostModel(profile(alltoallv=[[0, 1.0], [10, 1.0]], allgatherv=[[0, 2.0], [10, 2.0]]))
    m.profile["kernels"]["x"] = {"encode": [0, 1.0], "owner": [0, 0.5], "decode": [0, 0.25]}
    n, P = 8, 2
    kernels = 8 * 1.0 + 4 * 0.5 + 4 * 0.25
    assert m.twoshot("x", n, P, 10) == pytest.approx(m.overhead + kernels + 3.0)
    assert m.twoshot("x", n, P, 10, segments=4) == pytest.approx(
        m.overhead + max(kernels, 3.0) + min(kernels, 3.0) / 4)
    assert m.allgather("x", n, P, 10) == pytest.approx(m.overhead + 8 + 2.0 + 2 * 8 * 0.25)


def test_fit_kernel_is_a_line_through_the_samples():
    m = CostModel(copy.deepcopy(DEFAULT))
    m.fit_kernel("c", [(100, dict(encode=2e-6, owner=3e-6, decode=1e-6)),
                       (1100, dict(encode=12e-6, owner=3e-6, decode=0.5e-6))])
    assert m.kernel("c", "encode", 600) == pytest.approx(7e-6)
    assert m.kernel("c", "owner", 10**6) == pytest.approx(3e-6)
    assert m.kernel("c", "decode", 10**6) >= 0                  # no negative slopes


@pytest.mark.parametrize("bad,match", [
    ({"format": 2}, "format-1"),
    ({**DEFAULT, "patterns": {"allreduce": [[8, 1e-6]]}}, "needs the patterns"),
    (profile(alltoallv=[[8, float("nan")]]), "bad point"),
    ({**DEFAULT, "kernels": {"onebit": {"encode": [1, 2]}}}, "kernel costs of 'onebit'"),
    ({**DEFAULT, "overhead": -1}, "overhead"),
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
