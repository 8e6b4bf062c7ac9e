"""Validation results and their three renderings: a human table, one JSON object, JUnit XML."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from enum import Enum


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class CheckResult:
    """One named check: its outcome, a one-line reason, the seconds it took, details for JSON."""

    name: str
    group: str
    outcome: Outcome
    reason: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


@dataclass
class Report:
    model: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(check.outcome is Outcome.FAILED for check in self.checks)

    def summary(self) -> dict[str, int]:
        counts = {outcome.value: 0 for outcome in Outcome}
        for check in self.checks:
            counts[check.outcome.value] += 1
        return counts

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "checks": [
                {**dataclasses.asdict(check), "outcome": check.outcome.value}
                for check in self.checks
            ],
            "summary": {**self.summary(), "ok": not self.failed},
        }

    def to_table(self) -> str:
        width = max([len(check.name) for check in self.checks] + [5])
        lines = [f"{'check':<{width}}  {'result':<7}  reason"]
        lines += [f"{check.name:<{width}}  {check.outcome.value:<7}  {check.reason}"
                  for check in self.checks]
        summary = self.summary()
        lines.append(f"{summary['passed']} passed, {summary['failed']} failed, "
                     f"{summary['skipped']} skipped")
        return "\n".join(lines)

    def to_junit(self) -> str:
        summary = self.summary()
        suite = ET.Element(
            "testsuite",
            name=f"onnx-chunk validate {self.model}",
            tests=str(len(self.checks)),
            failures=str(summary["failed"]),
            skipped=str(summary["skipped"]),
            time=f"{sum(check.seconds for check in self.checks):.3f}",
        )
        for check in self.checks:
            case = ET.SubElement(suite, "testcase", classname=f"onnx_chunk.{check.group}",
                                 name=check.name, time=f"{check.seconds:.3f}")
            if check.outcome is Outcome.FAILED:
                ET.SubElement(case, "failure", message=check.reason).text = json.dumps(
                    check.details, indent=2, default=str)
            elif check.outcome is Outcome.SKIPPED:
                ET.SubElement(case, "skipped", message=check.reason)
        suites = ET.Element("testsuites")
        suites.append(suite)
        return ET.tostring(suites, encoding="unicode", xml_declaration=True)
