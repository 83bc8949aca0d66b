"""Running a check in a fresh interpreter under numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is imported, so the
simulator tests (``tests/test_cuda_*.py``) run each check function in a
subprocess with it set, and skip when the simulator cannot start here.
"""
import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}


@functools.lru_cache(maxsize=None)
def simulator_missing() -> str:
    """Why the simulator cannot run here, or '' when it can."""
    probe = subprocess.run([sys.executable, "-c", "from numba import cuda; cuda.to_device"],
                           env=ENV, capture_output=True, text=True, timeout=120)
    return "" if probe.returncode == 0 else probe.stderr.strip()[-200:]


def run_check(module: str, check: str, timeout: int = 300) -> None:
    """Run ``tests.<module>.<check>()`` on the simulator; fail with its output."""
    if simulator_missing():
        pytest.skip(f"numba.cuda simulator unavailable: {simulator_missing()}")
    proc = subprocess.run([sys.executable, "-c", f"from tests.{module} import {check}; "
                           f"{check}()"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
