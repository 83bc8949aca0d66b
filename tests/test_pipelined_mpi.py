"""``twoshot`` in segments against the unsegmented reference, bit for bit,
for every packet codec, with and without error feedback, at 2, 3 and 5
segments and at every P from 1 to 5: the MPI runs at 1, 2, 3 and 5 ranks,
and the ``wide`` run at 4 (not at 6 and 8, where the module skips before
it builds its cases)."""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs import packet_codecs

from .helpers import COMM, RANK, SIZE, digest

if SIZE > 5:
    pytest.skip("pipelining is checked at 1 to 5 ranks", allow_module_level=True)

pytestmark = [pytest.mark.mpi, pytest.mark.wide]

#: options that make the sparsifiers send something at these sizes
PIPELINE_OPTIONS = {"topk": {"ratio": 0.05}, "dgc": {"ratio": 0.05}, "randk": {"ratio": 0.1},
                    "threshold": {"alpha": 1.0}, "adaptive": {"proportion": 4}}


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("shape", [(1003,), (37, 29), (5, 4096), (3 * 4096 + 7,), (0,), (1,)])
@pytest.mark.parametrize("codec", [c for c in packet_codecs() if not c.startswith("test-")])
@pytest.mark.parametrize("ef", [True, False])
def test_pipelined_twoshot_gives_the_reference_bits(codec, shape, segments, ef):
    """``twoshot`` in segments (non-blocking all-to-all and allgather, each
    chunk cut at the codec's segment unit) against the unsegmented
    three-step reference (``fused=False``), over steps with residuals; codecs
    that cannot cut their chunks run unsegmented and must agree too."""
    if SIZE > 3 and shape not in ((1003,), (5, 4096)):
        pytest.skip("above three ranks: shapes (1003,) and (5, 4096) only")
    options = PIPELINE_OPTIONS.get(codec, {})
    got, segmented = {}, None
    for variant in ("pipelined", "reference"):
        pipelined = variant == "pipelined"
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=pipelined,
                                     error_feedback=ef, segments=segments if pipelined else 1,
                                     **options)
        hashes = []
        for step in range(3):
            rng = np.random.default_rng(100 * step + RANK)
            x = rng.standard_normal(shape).astype(np.float32)
            hashes.append(digest(reducer(x, key="g")))
        if pipelined:
            segmented = reducer.algorithm.segment_count(x.size, shape)
        saved = reducer.state_dict()["keys"]["g"]["residuals"]
        got[variant] = (hashes, {k: digest(v) for k, v in saved.items()})
    cuts = hpccomm.get_codec(codec, **options).segment_unit(shape) is not None
    assert segmented == (segments if cuts and SIZE > 1 else 1)
    assert got["pipelined"] == got["reference"]
