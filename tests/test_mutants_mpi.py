"""Every check must be able to fail: each broken variant of
:mod:`tests.mutants` goes through the checks of the suite that must catch it,
and they must fail -- on every codec family and every algorithm.

=======================  ===========================================================
mutant                   caught by
=======================  ===========================================================
zero decoder             the codec's band (``band_failure``, bench ``--check``);
                         its own reference pipeline agrees with it
swapped means            the codec tests' numpy reference of the decode; the band
                         (gain < 0) and bench ``--check`` where one encode stands
                         between input and result (twoshot's owner swaps back)
dropped residual         the reference pipeline over two calls with error feedback
                         (``pipeline_failures``, bench ``--check``'s second call),
                         the error-feedback invariant (``feedback_invariant_error``)
dropped owner residual   the reference pipeline over two calls, bench ``--check``
wrong owner order        the reference pipeline bit for bit, bench ``--check``; the
                         band cannot see it (P >= 3: two addends commute)
skipped rank             the reference pipeline, bench ``--check`` (P >= 2)
=======================  ===========================================================
"""
import numpy as np
import pytest

import hpccomm
from hpccomm.bench.allreduce import check_reference
from hpccomm.codecs.base import VECTOR_COLUMN, EncodeContext
from hpccomm.memory import get_memory

from . import mutants as M
from .helpers import COMM, SIZE, exact_sum, rank_data
from .test_codecs_sparse import feedback_invariant_error
from .test_collectives_mpi import CODEC_PARAMS, CODECS, SEED, band_failure, make_codec, \
    pipeline_failures

# narrow: that each check can fail is shown at up to 3 ranks; the checks themselves
# run at every rank count in the other files
pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

N_BENCH, SHAPE_BENCH = 4096, (4, 1024)


def caught(failures) -> bool:
    """Whether a check failed on any rank (collective)."""
    return any(COMM.allgather(bool(failures)))


def bench_failures(codec, algorithm, error_feedback=None, **options):
    """``bench allreduce --check``'s checks of a fresh reducer (collective)."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, seed=SEED,
                                 error_feedback=error_feedback, **options)
    x = rank_data(N_BENCH, seed=7).reshape(SHAPE_BENCH)
    failures, _, _ = check_reference(COMM, reducer, x, exact_sum(N_BENCH, seed=7))
    return failures


def zero_cases():
    out = []
    for c in CODECS:
        for a in ("twoshot", "allgather", "summable", "sparse_allgather"):
            if a == "summable" and not make_codec(c).summable:
                continue
            if a == "sparse_allgather" and (make_codec(c).lossless or make_codec(c).dense):
                continue        # a lossless codec's values go to sparse algorithms undecoded;
                                # the dense quantizers are refused by them
            out.append((c, a))
    return out


@pytest.mark.parametrize("codec,algorithm", zero_cases())
def test_zero_decoder_fails_the_band(codec, algorithm):
    params = CODEC_PARAMS.get(codec, {})
    zero = M.mutant_codec(M.ZeroDecoder, codec, **params)
    good = band_failure(make_codec(codec), algorithm)
    bad = band_failure(zero, algorithm)
    agrees = pipeline_failures(zero, algorithm, 1000)
    bench = bench_failures(M.mutant_codec(M.ZeroDecoder, codec, **params), algorithm)
    flags = caught(good), caught(bad), caught(agrees), caught(bench)
    assert flags == (False, True, False, True), (flags, good, bad, agrees, bench)
    # consistent with itself: only the band sees it
    assert any("gain 0 " in f for f in bench), bench


def codec_reference_decode(codec, x, ctx):
    """The decoded values the codec tests demand (their numpy references)."""
    if codec.endswith("onebit"):
        from .test_codecs_quant import ref_onebit_decode

        return ref_onebit_decode(x, min(x.size, VECTOR_COLUMN))
    from .test_codecs_sparse import ref_adaptive

    c = make_codec("adaptive")
    return ref_adaptive(x, min(x.size, VECTOR_COLUMN), c.proportion, c.excess, c.samples, ctx)


@pytest.mark.parametrize("codec", ["onebit", "adaptive"])
def test_swapped_means_fail_the_codec_tests_and_the_band(codec):
    """The codec tests' numpy reference of the decode sees the swap, and so
    does the band wherever one encode stands between input and result
    (allgather; twoshot at P = 1).  From P = 2 twoshot's owner decodes the
    sum with the means swapped again and sends it back swapped: the two
    swaps nearly cancel -- that pipeline is left to the codec tests."""
    params = CODEC_PARAMS.get(codec, {})
    swapped = M.mutant_codec(M.SwappedMeans, codec, **params)
    x, ctx = rank_data(1000, seed=8), EncodeContext(seed=5, rank=1, step=3)
    want = codec_reference_decode(codec, x, ctx)
    good_decode = np.array_equal(make_codec(codec).roundtrip(x, ctx), want)
    bad_decode = np.array_equal(swapped.roundtrip(x, ctx), want)
    bad = band_failure(swapped, "allgather")
    twoshot = band_failure(swapped, "twoshot")
    bench = bench_failures(M.mutant_codec(M.SwappedMeans, codec, **params), "allgather")
    flags = caught(bad), caught(bench), caught(twoshot)
    assert good_decode and not bad_decode
    assert flags == (True, True, SIZE == 1), (bad, bench, twoshot)
    assert "gain -" in bad, bad


#: (algorithm, codec, options) for the error-feedback mutants
FEEDBACK_CASES = [("twoshot", "onebit", {}), ("allgather", "topk", {}),
                  ("summable", "threshold", {}), ("sparse_allgather", "topk", {}),
                  ("hierarchical", "onebit", {"nodes": tuple(r % 2 for r in range(SIZE))})]


def feedback_codec(codec, algorithm):
    params = {"tau": 1.0} if algorithm == "summable" else CODEC_PARAMS.get(codec, {})
    return hpccomm.get_codec(codec, **params)


@pytest.mark.parametrize("algorithm,codec,options", FEEDBACK_CASES)
def test_dropped_residual_fails_the_reference(algorithm, codec, options):
    run = lambda memory: pipeline_failures(feedback_codec(codec, algorithm), algorithm, 1000,  # noqa: E731
                                           shape=(10, 100), steps=2, error_feedback=memory,
                                           **options)
    good, bad = run(get_memory("residual")), run(M.DroppedResidual())
    bench = bench_failures(feedback_codec(codec, algorithm), algorithm, M.DroppedResidual(),
                           **options)
    flags = caught(good), caught(bad), caught(bench)
    assert flags == (False, True, True), (good, bad, bench)
    assert all(f.startswith("call 2") for f in bad), bad
    assert all("call 2" in f for f in bench), bench


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("codec", ["onebit", "topk", "threshold", "qsgd"])
def test_dropped_residual_fails_the_feedback_invariant(codec, fuse):
    c = make_codec(codec)
    assert feedback_invariant_error(c, get_memory("residual"), fuse) <= 0
    assert feedback_invariant_error(c, M.DroppedResidual(), fuse) > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm,options", [
    ("twoshot", {}), ("hierarchical", {"nodes": tuple(r % 2 for r in range(SIZE))})])
def test_dropped_owner_residual_fails_the_reference(algorithm, options):
    codec = make_codec("onebit")
    bad = pipeline_failures(codec, algorithm, 1000, shape=(10, 100), steps=2,
                            error_feedback=M.DroppedOwnerResidual(), **options)
    bench = bench_failures(codec, algorithm, M.DroppedOwnerResidual(), **options)
    flags = caught(bad), caught(bench)
    assert flags == (True, True), (bad, bench)
    assert all(f.startswith("call 2") for f in bad), bad


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("codec", ["onebit", "qsgd", "topk"])
def test_wrong_owner_order_fails_the_reference_bit_for_bit(codec):
    """Summing the owner's packets in reverse rank order changes only the
    float rounding: the band cannot see it, the reference does.  (At P = 2
    the two addends commute: the same bits; fp16's and bf16's sums of three
    halves are exact in float32, any order alike; and onebit's sums take two
    values per rank and column, so it needs many columns to show.)"""
    with M.registered(M.reversed_owner()) as name:
        c = make_codec(codec)
        bad = pipeline_failures(c, name, 16384, shape=(64, 256))
        band = band_failure(c, name)
        bench = bench_failures(c, name)
    flags = caught(bad), caught(band), caught(bench)
    assert flags == (True, False, True), (bad, band, bench)
    assert "bits differ" in bad[0], bad


SKIP_CASES = ([("twoshot", "onebit", {}), ("allgather", "qsgd", {}), ("summable", "terngrad", {}),
               ("mpi", "none", {}), ("auto", "none", {"policy": {"*": "dense"}}),
               ("hierarchical", "onebit", {"nodes": tuple(r // 2 for r in range(SIZE))})]
              + [(a, "topk", {}) for a in hpccomm.sparse_algorithms()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm,codec,options", SKIP_CASES)
def test_skipped_rank_fails_the_reference(algorithm, codec, options):
    with M.registered(M.skipping(algorithm)) as name:
        c = make_codec(codec)
        bad = pipeline_failures(c, name, 1000, **options)
        bench = bench_failures(c, name, **options)
    flags = caught(bad), caught(bench)
    assert flags == (True, True), (bad, bench)


def test_mutants_leave_the_registries_alone():
    assert not any(a.startswith(M.MUTANT) for a in hpccomm.available_algorithms())
    assert not any(c.startswith(M.MUTANT) for c in hpccomm.available_codecs())
