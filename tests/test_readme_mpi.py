"""The README's Python examples run as written (under mpiexec, every rank)."""
import os
import re

import numpy as np
import pytest

from .helpers import COMM, RANK

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.mpi
def test_readme_python_examples_run():
    blocks = _blocks()
    assert len(blocks) >= 3
    rng = np.random.default_rng(RANK)
    # names the later snippets take from the reader's program
    ns = {"indices": rng.integers(0, 1 << 24, size=1000),
          "values": rng.standard_normal(1000).astype(np.float32),
          "grads": {"fc.weight": rng.standard_normal((10, 64)).astype(np.float32),
                    "conv.weight": rng.standard_normal((64, 300)).astype(np.float32),
                    "conv.bias": rng.standard_normal(64).astype(np.float32)}}
    try:
        import torch  # noqa: F401
    except ImportError:   # the PyTorch examples need it (./dev.sh installs a CPU build)
        blocks = [b for b in blocks if "import torch" not in b]
    for block in blocks:
        exec(compile(block, README, "exec"), ns)  # noqa: S102 - our own documentation
    assert ns["comm"] is not None and ns["total"].shape == (1 << 24,)
    assert ns["result"].n == 1 << 24
    COMM.Barrier()
