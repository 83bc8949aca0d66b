"""Reused host buffers through which device data is staged when MPI cannot
read device memory."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .device import DeviceBackend


class HostStaging:
    """Reused host buffers for staging device data (pinned when possible)."""

    def __init__(self):
        self._buffers = {}

    def get(self, slot: str, nbytes: int, backend: Optional[DeviceBackend]) -> np.ndarray:
        buf = self._buffers.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = backend.pinned_empty(nbytes) if backend is not None else np.empty(nbytes, np.uint8)
            self._buffers[slot] = buf
        return buf[:nbytes]
