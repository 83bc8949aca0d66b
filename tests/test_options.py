"""Option routing and the registries (no MPI)."""
import pytest

import hpccomm
from hpccomm.codecs.base import CODECS, Codec
from hpccomm.collectives.base import ALGORITHMS, Algorithm
from hpccomm.options import option_names, resolve_options
from hpccomm.registry import Registry


def test_options_go_to_the_constructor_that_takes_them():
    c, a = resolve_options("topk", "kylix", {"ratio": 0.1, "degrees": (2, 2), "nonfinite": "raise"})
    assert c == {"ratio": 0.1, "nonfinite": "raise"} and a == {"degrees": (2, 2)}
    assert resolve_options(None, "rle_pipeline", {"block": 8}) == ({}, {"block": 8})


def test_scoped_options_apply_only_to_their_target():
    opts = {"topk.ratio": 0.1, "dgc.ratio": 0.001, "kylix.degrees": (2,)}
    assert resolve_options("topk", "twoshot", opts, strict=False) == ({"ratio": 0.1}, {})
    assert resolve_options("dgc", "kylix", opts, strict=False) == (
        {"ratio": 0.001}, {"degrees": (2,)})
    with pytest.raises(TypeError, match="scoped to 'dgc'"):
        resolve_options("topk", "twoshot", {"dgc.ratio": 0.1})


def test_unknown_option_names_what_is_taken():
    with pytest.raises(TypeError) as info:
        resolve_options("qsgd", "twoshot", {"ratio": 0.1})
    msg = str(info.value)
    assert "unknown option 'ratio' for codec 'qsgd' and algorithm 'twoshot'" in msg
    assert "codec 'qsgd' takes bits, bucket, elias, nonfinite, norm" in msg
    assert "algorithm 'twoshot' takes segments" in msg
    with pytest.raises(TypeError, match="unknown option 'bogus' for algorithm 'kylix' "
                                        r"\(algorithm 'kylix' takes degrees, hash_indices\)"):
        resolve_options(None, "kylix", {"bogus": 1})
    # not strict: left out, nothing raised
    assert resolve_options("qsgd", "twoshot", {"ratio": 0.1}, strict=False) == ({}, {})


def test_a_name_both_take_must_be_scoped(monkeypatch):
    class Clash(Algorithm):
        name = "test-clash"

        def __init__(self, comm, codec, ratio=1.0):
            super().__init__(comm, codec)

    monkeypatch.setitem(ALGORITHMS._classes, "test-clash", Clash)
    with pytest.raises(TypeError, match="taken by both codec 'topk' and algorithm 'test-clash'"):
        resolve_options("topk", "test-clash", {"ratio": 0.5})
    assert resolve_options("topk", "test-clash", {"test-clash.ratio": 0.5}) == (
        {}, {"ratio": 0.5})


def test_option_names_of_instances_and_unknown_names_are_empty():
    assert option_names(hpccomm.get_codec("topk"), "nope") == (frozenset(), frozenset())
    assert "degrees" in option_names(None, "kylix")[1]


def test_registry_rejects_duplicates_and_bad_names():
    reg = Registry("thing")

    class A:
        name = "a"

    class B:
        name = "a"

    reg.register(A)
    reg.register(A)  # the same class again is fine
    with pytest.raises(ValueError, match="thing name 'a' is already taken by"):
        reg.register(B)
    with pytest.raises(ValueError, match="unknown thing 'b'; available: a"):
        reg.get("b")
    with pytest.raises(TypeError, match="thing must be a name"):
        reg.get(3)
    assert reg.names() == ("a",) and "a" in reg


def test_codec_ids_stay_unique():
    class Dup(Codec):
        name = "test-dup-id"
        codec_id = CODECS.get("topk").codec_id

    with pytest.raises(ValueError, match="codec id .* is already taken by 'topk'"):
        hpccomm.register_codec(Dup)
    assert "test-dup-id" not in CODECS


def test_allreducer_reports_its_configuration_error_without_raising():
    r = hpccomm.Allreducer(codec="onebit", algorithm="mpi")
    assert isinstance(r.config_error, ValueError) and "takes codec='none'" in str(r.config_error)
    assert hpccomm.Allreducer(codec="onebit", algorithm="twoshot").config_error is None

