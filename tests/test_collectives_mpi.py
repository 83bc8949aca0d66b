"""Quantized allreduce algorithms (twoshot, allgather, summable) on real MPI,
for every registered codec.

The central check follows DeepSpeed's reference test: gather every rank's
input, run the same pipeline in one process with the codec alone
(:mod:`hpccomm.reference`), and demand the same bits from the distributed
algorithm -- call after call with error feedback, the reference carrying the
residuals itself.  Around it: bit identity across ranks, exactness where the
lossy path is lossless, the codec's theory against the exact float64 sum
(:func:`hpccomm.reference.error_band`), error feedback converging, state
save/restore, and mismatches raising everywhere.  ``tests/mutants.py`` holds
broken variants each of these checks must catch (``test_mutants_mpi.py``).
"""
import numpy as np
import pytest

import hpccomm
from hpccomm import reference
from hpccomm.codecs.base import VECTOR_COLUMN, packet_codecs
from hpccomm.errors import ConsistencyError

from .helpers import COMM, RANK, SIZE, exact_sum, raise_everywhere, rank_data, same_on_all_ranks

pytestmark = pytest.mark.mpi

#: parameters that make each codec valid (and interesting) in these tests
CODEC_PARAMS = {
    "threshold": {"alpha": 1.0},
    "topk": {"ratio": 0.2},
    "randk": {"ratio": 0.25},
    "dgc": {"ratio": 0.2},
    "adaptive": {"proportion": 4},
    "qsgd": {"bits": 4, "bucket": 64},
    "qsgd+rotate": {"bits": 4, "bucket": 64, "rotate_block": 64},
    "onebit+rotate": {"rotate_block": 256},
}
CODECS = [c for c in packet_codecs() if not c.startswith("test-")]
#: ``rotate=True`` (an option of the dense quantizers, not a registered
#: name) in the pipeline tests of :func:`cases`
ROTATED = ["qsgd+rotate", "onebit+rotate"]
#: layout variants of a codec that run the registry-parametrised cases too,
#: as "name:variant" (their own wire format: ``qsgd``'s Elias coding)
VARIANTS = {"qsgd:elias": ("qsgd", {"bits": 4, "bucket": 64, "elias": True})}
LENGTHS = [0, 1, 7, 33, 1000, 4097]
SEED = 11


def make_codec(name):
    if name in VARIANTS:
        base, params = VARIANTS[name]
        return hpccomm.get_codec(base, **params)
    return hpccomm.get_codec(name, **CODEC_PARAMS.get(name, {}))


def cases(algorithms):
    out = []
    for c in CODECS + ROTATED + [v for v in VARIANTS if VARIANTS[v][0] in CODECS]:
        for a in algorithms:
            if a == "summable" and not make_codec(c).summable:
                continue
            out.append((c, a))
    return out


def gather_inputs(x):
    return COMM.allgather(x)


def pipeline_failures(codec, algorithm, n, shape=None, steps=1, error_feedback=False, seed=3,
                      **options):
    """``steps`` calls of a reducer (``codec`` an instance, ``error_feedback``
    as the reducer takes it) on per-rank inputs of ``n`` elements, against
    :class:`hpccomm.reference.Pipeline` on the gathered inputs: what failed
    (the same list on every rank).  Collective."""
    shape = (n,) if shape is None else shape
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, seed=SEED,
                                 error_feedback=error_feedback, **options)
    xs, results = [], []
    for step in range(steps):
        x = rank_data(n, seed=seed + step).reshape(shape)
        results.append(reducer(x, key="k").reshape(-1))
        xs.append(gather_inputs(x.reshape(-1)))
    failures = [f"call {t + 1}: ranks disagree" for t, r in enumerate(results)
                if not same_on_all_ranks(r)]
    pipe = reference.Pipeline(codec, algorithm, SIZE, shape, seed=SEED,
                              error_feedback=reducer.memory.enabled,
                              choice=reducer.stats.last.extra.get("auto"),
                              **{k: options[k] for k in ("nodes", "outer") if k in options})
    for t, (inputs, res) in enumerate(zip(xs, results)):
        msg = reference.compare(res, pipe(inputs))
        if msg:
            failures.append(f"call {t + 1}: {msg}")
    return failures


def band_failure(codec, algorithm, n=2000, shape=(20, 100), **options):
    """A fresh reducer's result on N(0, 1) inputs against the codec's band
    (:func:`hpccomm.reference.error_band`): the failure, or None.  Collective."""
    x = rank_data(n, seed=5)
    res = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, seed=SEED,
                             error_feedback=False, **options)(x.reshape(shape)).reshape(-1)
    band = reference.error_band(codec, algorithm, SIZE, n, shape)
    assert band is not None, f"no band for {codec} on {n} elements"
    return reference.check_band(res, exact_sum(n, seed=5), band)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("codec,algorithm", cases(["twoshot", "allgather", "summable"]))
def test_matches_single_process_simulation(codec, algorithm, n):
    """Bit for bit (or within reassociation where MPI sums float32 codes:
    random-k's) the reference pipeline, on every rank."""
    failures = pipeline_failures(make_codec(codec), algorithm, n)
    assert not failures, failures


@pytest.mark.parametrize("codec,algorithm", [
    (c, a) for c, a in cases(["twoshot", "allgather", "summable"])
    if a != "summable" or make_codec(c).summable_feedback])
def test_error_feedback_matches_the_reference_pipeline(codec, algorithm):
    """Three calls with error feedback: every call equal to the reference,
    which carries each rank's worker and owner residuals itself."""
    failures = pipeline_failures(make_codec(codec), algorithm, 1000, shape=(10, 100), steps=3,
                                 error_feedback=True)
    assert not failures, failures


@pytest.mark.parametrize("algorithm", hpccomm.sparse_algorithms())
@pytest.mark.parametrize("codec", ["topk", "threshold", "randk"])
def test_sparse_algorithms_match_the_reference_pipeline(codec, algorithm):
    """The sparse algorithms through the reducer, with error feedback: the
    sum of every rank's sparsified contribution (reassociated from P = 3)."""
    failures = pipeline_failures(make_codec(codec), algorithm, 3001, steps=2,
                                 error_feedback=True)
    assert not failures, failures


@pytest.mark.parametrize("codec,algorithm", cases(["twoshot", "allgather", "summable"]))
def test_error_bound_against_exact_sum(codec, algorithm):
    """gain = <r, s> / <s, s> and rel_err = |r - s| / |s| against the exact
    float64 sum, within the range the codec's theory gives for N(0, 1)
    inputs -- not derived from the codec's own round trip, so a codec that
    decodes to zeros (gain 0, rel_err 1) fails it."""
    failure = band_failure(make_codec(codec), algorithm)
    assert failure is None, failure


@pytest.mark.parametrize("algorithm", ["twoshot", "allgather", "summable"])
def test_none_codec_is_exact(algorithm):
    x = rank_data(4097, integers=True)
    res = hpccomm.allreduce(x, codec="none", algorithm=algorithm)
    assert same_on_all_ranks(res)
    np.testing.assert_array_equal(res, exact_sum(4097, integers=True).astype(np.float32))


@pytest.mark.skipif("fp16" not in CODECS, reason="fp16 codec not registered")
@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
def test_fp16_is_exact_on_integers(algorithm):
    x = rank_data(1001, integers=True)
    res = hpccomm.allreduce(x, codec="fp16", algorithm=algorithm)
    np.testing.assert_array_equal(res, exact_sum(1001, integers=True).astype(np.float32))


@pytest.mark.skipif("onebit" not in CODECS, reason="onebit codec not registered")
@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
@pytest.mark.parametrize("sign", [1, -1])
def test_onebit_is_exact_on_constant_columns(algorithm, sign):
    x = np.full((12, 16), sign * (RANK + 1), dtype=np.float32)
    res = hpccomm.allreduce(x, codec="onebit", algorithm=algorithm)
    np.testing.assert_array_equal(res, np.full((12, 16), sign * SIZE * (SIZE + 1) / 2,
                                                dtype=np.float32))


@pytest.mark.skipif("topk" not in CODECS, reason="topk codec not registered")
@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
def test_topk_keeping_everything_is_exact(algorithm):
    x = rank_data(777, integers=True)
    res = hpccomm.allreduce(x, codec="topk", algorithm=algorithm, ratio=1.0)
    np.testing.assert_array_equal(res, exact_sum(777, integers=True).astype(np.float32))


@pytest.mark.parametrize("codec,algorithm", [
    (c, a) for c, a in cases(["twoshot", "allgather", "summable"]) if make_codec(c).biased])
def test_error_feedback_running_mean_converges(codec, algorithm):
    """Reducing the same vector again and again with error feedback, the
    running mean of the results approaches the exact sum (the residuals carry
    what each step left out)."""
    n = 512
    # shaped as a layer's gradient: onebit reconstructs per column (of 32 here)
    x = rank_data(n, seed=9).reshape(16, 32)
    exact = exact_sum(n, seed=9).reshape(16, 32)
    # threshold: its default alpha (4: alpha = 1 keeps the cap from carrying
    # the gradient, which then piles up in the residual)
    params = {} if codec == "threshold" else CODEC_PARAMS.get(codec, {})
    reducer = hpccomm.Allreducer(codec=codec, algorithm=algorithm, error_feedback=True,
                                 seed=SEED, **params)
    acc = np.zeros((16, 32), dtype=np.float64)
    errors = {}
    for t in range(1, 65):
        acc += reducer(x, key="w")
        if t in (1, 8, 64):
            errors[t] = float(np.linalg.norm(acc / t - exact) / np.linalg.norm(exact))
    assert same_on_all_ranks(acc)
    assert errors[64] < errors[1] / 4, errors
    assert errors[64] < 0.1, errors


@pytest.mark.parametrize("codec,algorithm", [
    (c, a) for c, a in cases(["twoshot"]) if make_codec(c).biased])
def test_state_dict_resumes_bit_for_bit(codec, algorithm):
    x = rank_data(300, seed=2)
    params = CODEC_PARAMS.get(codec, {})
    a = hpccomm.Allreducer(codec=codec, algorithm=algorithm, error_feedback=True, **params)
    for _ in range(3):
        a(x, key="w")
    saved = a.state_dict()
    b = hpccomm.Allreducer(codec=codec, algorithm=algorithm, error_feedback=True, **params)
    b.load_state_dict(saved)
    ra, rb = a(x, key="w"), b(x, key="w")
    assert saved["keys"]["w"]["residuals"], "no residual was kept"
    if SIZE > 1 and algorithm == "twoshot":
        assert "owner" in saved["keys"]["w"]["residuals"]
    np.testing.assert_array_equal(ra, rb)
    a.reset("w")
    assert "w" not in a.state_dict()["keys"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["twoshot", "allgather"])
def test_mismatched_codecs_raise_everywhere(algorithm):
    other = "fp16" if "fp16" in CODECS else "none"
    codec = other if RANK == SIZE - 1 else "none"
    if other == "none":
        pytest.skip("needs a second codec")
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(10, np.float32), codec=codec, algorithm=algorithm))
    assert name == "ConsistencyError" and "codec=fp16" in message and agreed


@pytest.mark.parametrize("options", [{"rotate": True}, {"rotate": True, "rotate_block": 64}])
def test_rotated_twoshot_in_segments_matches_the_reference(options):
    """A rotated codec pipelines twoshot in segments (its segment unit is a
    multiple of the rotation block): two calls with error feedback, each
    equal to the reference pipeline."""
    codec = hpccomm.get_codec("qsgd", bits=4, bucket=64, **options)
    failures = pipeline_failures(codec, "twoshot", 4097, steps=2, error_feedback=True,
                                 segments=3)
    assert not failures, failures


@pytest.mark.mpi(min_size=2)
def test_mismatched_rotation_raises_everywhere():
    opts = {"rotate": True, "rotate_block": 64 if RANK == SIZE - 1 else 128}
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(10, np.float32), codec="qsgd", algorithm="twoshot",
                                  **opts))
    assert name == "ConsistencyError" and "rotate_block=64" in message and agreed


@pytest.mark.mpi(min_size=2)
def test_mismatched_lengths_raise_everywhere_for_compressed_algorithms():
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(10 + RANK, np.float32), algorithm="twoshot"))
    assert name == ConsistencyError.__name__ and "n=10" in message and agreed


def test_qsgd_elias_mismatch_and_summable_raise_everywhere():
    """``elias`` is a parameter every rank must share, and the summable
    form (integer codes) refuses it."""
    if "qsgd" not in CODECS:
        pytest.skip("needs qsgd")
    elias = RANK == SIZE - 1
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(10, np.float32), codec="qsgd", elias=elias,
                                  algorithm="twoshot"))
    if SIZE > 1:
        assert name == "ConsistencyError" and "elias=True" in message and agreed
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(4, np.float32), codec="qsgd", elias=True,
                                  algorithm="summable"))
    assert name == "ValueError" and "elias=False" in message and agreed


def test_summable_refuses_non_summable_codecs():
    non_summable = [c for c in CODECS if not make_codec(c).summable]
    if not non_summable:
        pytest.skip("every registered codec is summable")
    (name, message), agreed = raise_everywhere(
        lambda: hpccomm.allreduce(np.zeros(4, np.float32), codec=non_summable[0],
                                  algorithm="summable"))
    assert name == "ValueError" and "needs a summable codec" in message and agreed


@pytest.mark.parametrize("codec", CODECS)
def test_stats_count_bytes_and_phases(codec):
    n = 4096
    r = hpccomm.Allreducer(codec=codec, algorithm="twoshot", **CODEC_PARAMS.get(codec, {}))
    r(rank_data(n), key="k")
    last = r.stats.last
    assert last.n == n and last.nbytes == 4 * n
    if SIZE > 1:
        assert last.bytes_sent > 0 and last.bytes_recv > 0 and last.t_comm > 0
    else:
        assert last.bytes_sent == 0
    assert last.t_encode > 0 and last.t_decode > 0
    size = make_codec(codec).wire_size(n // SIZE) if make_codec(codec).fixed_size else None
    if size is not None and SIZE > 1 and n % SIZE == 0 and make_codec(codec).align((n,)) == 1:
        # all-to-all: P-1 chunk packets out; allgather: P-1 owner packets in
        assert last.bytes_sent == 2 * (SIZE - 1) * size


def alltoall_shares(codec, n, **options):
    """Every rank's bytes into twoshot's all-to-all for a 1-D vector of ``n``,
    and one column's packet bytes."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", error_feedback=False,
                                 **options)
    x = rank_data(n, RANK)
    reducer(x)
    return COMM.allgather(reducer.stats.last.bytes_sent)


@pytest.mark.parametrize("codec", ["onebit", "adaptive"])
def test_per_column_codecs_on_1d_input_give_every_rank_a_fair_share(codec):
    """The wire bytes of twoshot on a 1-D vector are spread evenly: no rank
    sends more than 1/P of the total by more than one column's packet in each
    of the two phases (all-to-all, allgather) plus the headers.  With a whole-vector column (the old default, passed explicitly
    here) rank 0 owned every chunk and the check fails."""
    n = 1024 * 1024 + 13
    # one column's packet: onebit's format; adaptive's documented bound for one column
    col_bytes = (16 + 8 + VECTOR_COLUMN // 8 if codec == "onebit" else
                 hpccomm.get_codec(codec, col_len=VECTOR_COLUMN).max_wire_size(VECTOR_COLUMN))
    def fair(shares):
        total = sum(shares)
        return max(shares) <= total / SIZE + 2 * col_bytes + 16 * SIZE
    balanced = alltoall_shares(codec, n)
    whole = alltoall_shares(codec, n, col_len=n)
    assert fair(balanced), balanced
    if SIZE > 1:
        assert not fair(whole), whole


@pytest.mark.parametrize("segments", [1, 3])
def test_large_packets_go_to_mpi_in_place(segments):
    """Above ``IN_PLACE_BYTES`` of packets, twoshot's all-to-all reads them
    where they lie: the lossless codec still gives the exact sum of integers."""
    from hpccomm.collectives.twoshot import IN_PLACE_BYTES

    n = IN_PLACE_BYTES // 2 + 1001
    x = rank_data(n, integers=True)
    res = hpccomm.Allreducer(codec="none", algorithm="twoshot", segments=segments)(x)
    np.testing.assert_array_equal(res, exact_sum(n, integers=True).astype(np.float32))
