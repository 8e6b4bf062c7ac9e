"""Building check results with the time each check took."""

from __future__ import annotations

import time
from typing import Any

from onnx_chunk.validate.report import CheckResult, Outcome


class Stopwatch:
    """Started when a check starts; `result` stamps the seconds since."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._start = time.perf_counter()

    def restart(self) -> None:
        self._start = time.perf_counter()

    def result(self, check: str, outcome: Outcome, reason: str,
               details: dict[str, Any] | None = None) -> CheckResult:
        seconds = time.perf_counter() - self._start
        self._start = time.perf_counter()
        return CheckResult(name=f"{self.group}.{check}", group=self.group, outcome=outcome,
                           reason=reason, seconds=seconds, details=details or {})
