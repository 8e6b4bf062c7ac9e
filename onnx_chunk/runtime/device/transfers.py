"""Host-device traffic, counted where it happens.

Every copy between the host and a device buffer goes through `DeviceBuffer` (`buffers`), which
adds its bytes here; every input synchronisation before a run goes through `Device.run`. On a
device whose memory the host reads in place (the CPU provider's default path) nothing crosses,
and the counts stay 0. A `Device` holds one `Transfers`; `Runtime.stats.transfers` reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferStats:
    """Bytes copied host to device and device to host, and input synchronisations, so far."""

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    synchronizations: int = 0


class Transfers:
    """The counters behind `TransferStats` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in = 0
        self._out = 0
        self._syncs = 0

    def to_device(self, nbytes: int) -> None:
        with self._lock:
            self._in += nbytes

    def to_host(self, nbytes: int) -> None:
        with self._lock:
            self._out += nbytes

    def synchronized(self) -> None:
        with self._lock:
            self._syncs += 1

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(self._in, self._out, self._syncs)
