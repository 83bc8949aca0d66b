"""How algorithms cut vectors into per-rank chunks (no MPI)."""
import numpy as np
import pytest

from hpccomm.collectives.base import chunk_bounds


@pytest.mark.parametrize("n", [0, 1, 5, 4095, 4096, 4097, 65 * 4096 + 13, 10 ** 6 + 7])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("align", [1, 7, 4096])
def test_chunk_bounds_are_aligned_and_within_one_unit_of_fair(n, parts, align):
    b = chunk_bounds(n, parts, align)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == n and all(np.diff(b) >= 0)
    assert all(int(s) % align == 0 for s in b[:-1])
    lens = np.diff(b)
    assert lens.max() - lens.min() <= align
    assert all(abs(int(m) - n / parts) <= align for m in lens)
