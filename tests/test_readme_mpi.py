"""The Python examples of the README and of the user guide run as written
(under mpiexec, every rank): each page's blocks in order, in one namespace."""
import glob
import os
import re

import numpy as np
import pytest
from mpi4py import MPI

from .helpers import COMM, RANK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "guide", "*.md")))


def _blocks(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def _namespace():
    """Names the snippets take from the reader's program."""
    rng = np.random.default_rng(RANK)
    return {"comm": MPI.COMM_WORLD,
            "indices": rng.integers(0, 1 << 24, size=1000),
            "values": rng.standard_normal(1000).astype(np.float32),
            "grads": {"fc.weight": rng.standard_normal((10, 64)).astype(np.float32),
                      "conv.weight": rng.standard_normal((64, 300)).astype(np.float32),
                      "conv.bias": rng.standard_normal(64).astype(np.float32)}}


def test_pages_have_examples():
    # the README shows the three uses (mpi4py, GradReducer, the DDP hook)
    readme = "\n".join(_blocks("README.md"))
    assert "hpccomm.allreduce(" in readme and "GradReducer(" in readme
    assert "register_comm_hook" in readme
    assert sum(len(_blocks(p)) for p in PAGES) >= 8


@pytest.mark.mpi
@pytest.mark.narrow
@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run(page):
    blocks = _blocks(page)
    try:
        import torch  # noqa: F401
    except ImportError:   # the PyTorch examples need it (./dev.sh installs a CPU build);
        # the blocks after one may use what it made (a page's model)
        first = next((i for i, b in enumerate(blocks) if "import torch" in b), len(blocks))
        blocks = blocks[:first]
    ns = _namespace()
    for block in blocks:
        exec(compile(block, page, "exec"), ns)  # noqa: S102 - our own documentation
    if page == "README.md":
        assert ns["total"].shape == (1 << 20,) and ns["approx"].shape == (1 << 20,)
        assert ns["reducer"] is not None
    COMM.Barrier()
