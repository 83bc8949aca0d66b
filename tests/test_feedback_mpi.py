"""Error feedback converges: the time average of the results of a repeated
input approaches the exact sum.

With error feedback the results of ``T`` calls on the same ``g`` add up to
``T sum(g) - sum(e_T)`` (the residuals telescope), so the time average's
error is the final residual over ``T``: it falls as ``1 / T`` exactly when
the residual stays bounded.  Two ways it did not:

* ``threshold`` took ``tau = alpha * RMS`` of the compensated ``v = g + e``;
  the residual of the unsent elements grew, ``tau`` with it, and most
  elements were never sent (relative error 0.96 after 400 steps);
* the unbiased codecs (qsgd, terngrad, randk) are not contractive: their
  residual grew without bound.
"""
import numpy as np
import pytest

import hpccomm

from .helpers import COMM, exact_sum, raise_everywhere, rank_data, same_on_all_ranks

# narrow: convergence of the codecs' residuals over repeated calls, a layer above the
# collectives, which tests/test_collectives_mpi.py runs at every rank count
pytestmark = [pytest.mark.mpi, pytest.mark.narrow]


def time_average_errors(reducer, n, steps, checkpoints, seed=5):
    """Relative errors of the running mean of ``steps`` calls on this rank's
    fixed ``rank_data(n, seed)`` against the exact sum, at ``checkpoints``;
    and the final worker residual's norm relative to the input's."""
    g = rank_data(n, seed=seed)
    exact = exact_sum(n, seed=seed)
    acc = np.zeros(n)
    errors = {}
    for t in range(1, steps + 1):
        acc += reducer(g, key="g")
        if t in checkpoints:
            errors[t] = float(np.linalg.norm(acc / t - exact) / np.linalg.norm(exact))
    e = reducer.state_dict()["keys"]["g"]["residuals"]["worker"]
    return errors, float(np.linalg.norm(e) / np.linalg.norm(g)), acc


@pytest.mark.parametrize("algorithm,fused", [("allgather", True), ("twoshot", True),
                                             ("twoshot", False), ("sparse_allgather", True)])
def test_threshold_default_time_average_converges(algorithm, fused):
    """The default threshold (``tau = alpha * RMS(g)`` of the fresh gradient,
    ``alpha = 1 / max_ratio = 4``) on a repeated Gaussian of 100,003
    elements: the time average's error falls as ``1 / t`` (about 0.05 at
    ``t = 50`` and 0.02 at ``t = 150`` at P = 3; ``tau`` from ``v`` stayed at
    0.96), in the fused kernel, the reference path (``fused=False``, the
    owner's re-encode) and the sparse pairs alike."""
    reducer = hpccomm.Allreducer(COMM, codec="threshold", algorithm=algorithm, fused=fused)
    assert reducer.memory.enabled
    errors, residual, acc = time_average_errors(reducer, 100_003, 150, (50, 150))
    agree = same_on_all_ranks(acc)
    assert agree
    assert errors[150] < 0.05, errors
    assert errors[150] < 0.5 * errors[50], errors


#: parameters and a bound on the time average's error after 128 steps (measured
#: at P = 1 and 3: 0.025 / 0.045 for both qsgd, 0.03 / 0.047 for terngrad, 0.10
#: for randk, with allgather / twoshot -- whose owners re-encode under a
#: residual of their own)
UNBIASED = [("qsgd", {}, 0.1), ("qsgd", {"bits": 2, "norm": "max"}, 0.1),
            ("terngrad", {}, 0.1), ("randk", {"ratio": 0.1}, 0.2)]


@pytest.mark.parametrize("algorithm", ["allgather", "twoshot"])
@pytest.mark.parametrize("codec,params,bound", UNBIASED)
def test_unbiased_codecs_with_feedback_stay_bounded(codec, params, bound, algorithm):
    """``error_feedback=True`` with an unbiased codec sends its contractive
    form ``C / (1 + omega)`` (see each codec's docstring): the residual stays
    bounded and the time average converges.  The unbiased form's residuals
    grew in these 128 steps (P = 3): terngrad's to 23 ``||g||``, qsgd's to 3e4
    ``||g||``, randk's past float32's range."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, error_feedback=True,
                                 seed=3, **params)
    errors, residual, acc = time_average_errors(reducer, 20_000, 128, (16, 128))
    agree = same_on_all_ranks(acc)
    assert agree
    assert residual < 20, (residual, errors)
    assert errors[128] < bound and errors[128] < 0.3 * errors[16], errors


def test_the_default_stays_off_for_unbiased_codecs():
    for codec in ("qsgd", "terngrad", "randk"):
        assert not hpccomm.Allreducer(COMM, codec=codec, algorithm="allgather").memory.enabled


@pytest.mark.parametrize("algorithm,options", [("summable", {}),
                                               ("hierarchical", {"outer": "summable"})])
@pytest.mark.parametrize("codec", ["qsgd", "terngrad"])
def test_summable_refuses_feedback_with_unbiased_quantizers(codec, algorithm, options):
    """Their codes are summed against one shared scale, which no rank can
    contract alone: error feedback is refused on every rank, naming it."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, error_feedback=True,
                                 **options)
    got, same = raise_everywhere(lambda: reducer(np.ones(100, np.float32), key="g"))
    assert same
    assert got[0] == "ValueError" and "error feedback" in got[1] and codec in got[1], got
    plain = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, **options)
    assert plain(np.ones(100, np.float32), key="g").shape == (100,)


def test_randk_summable_with_feedback_converges():
    """randk's summable form sends the unscaled values under feedback, like
    its packets: the same results as ``allgather`` (an exact float sum of
    the same values at P <= 2; in any case bounded and converging)."""
    reducer = hpccomm.Allreducer(COMM, codec="randk", algorithm="summable", ratio=0.1,
                                 error_feedback=True, seed=3)
    errors, residual, acc = time_average_errors(reducer, 20_000, 128, (16, 128))
    agree = same_on_all_ranks(acc)
    assert agree
    assert residual < 20 and errors[128] < 0.2 and errors[128] < 0.3 * errors[16], errors
