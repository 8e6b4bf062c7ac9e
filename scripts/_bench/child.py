"""One measurement in its own process: its JSON result, wall time and its own peak RSS.

The peak resident set is the child's own `VmHWM`, which it writes at exit through
`peak_launcher` (the child runs as `python peak_launcher.py SCRIPT ARGS...`). `wait4`'s
`ru_maxrss` is not used: on Linux it starts from the parent's resident set at fork and
survives exec, so `python -c pass` spawned from a 400 MB parent reported 413 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .peak_launcher import PEAK_FILE_ENV


class ChildFailed(RuntimeError):
    """A measurement process exited with an error or printed no result."""


@dataclass(frozen=True)
class ChildResult:
    """What one measurement process reported, with its peak RSS and wall time.

    `started_at`: `time.monotonic()` just before the process was spawned (CLOCK_MONOTONIC,
    the same clock in every process of the machine, so a child's own `time.monotonic()`
    stamps minus it are seconds since its spawn).
    """

    payload: dict
    peak_rss_mb: float
    wall_s: float
    started_at: float


LAUNCHER = Path(__file__).resolve().parent / "peak_launcher.py"


def run_child(argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None
              ) -> ChildResult:
    """Run the Python command line `argv` ([python, script or -c code, args...]); it must
    print one JSON object as its last stdout line."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(prefix="peak.") as peak:
        child_env = dict(os.environ if env is None else env)
        child_env[PEAK_FILE_ENV] = peak.name
        started_at = time.monotonic()
        began = time.perf_counter()
        process = subprocess.Popen([argv[0], str(LAUNCHER), *argv[1:]], stdout=out,
                                   stderr=err, env=child_env)
        deadline = began + timeout_s
        while True:
            pid, status, _ = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                process.kill()
                os.wait4(process.pid, 0)
                raise ChildFailed(f"{argv[1]} ran past {timeout_s:.0f} s and was killed")
            time.sleep(0.02)
        wall = time.perf_counter() - began
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        peak_kib = Path(peak.name).read_text().strip()
    if process.returncode != 0:
        raise ChildFailed(f"{' '.join(argv[:2])} exited with {process.returncode}:\n"
                          f"{stderr[-3000:]}")
    lines = stdout.strip().splitlines()
    if not lines:
        raise ChildFailed(f"{' '.join(argv[:2])} printed no result:\n{stderr[-3000:]}")
    if not peak_kib:
        raise ChildFailed(f"{' '.join(argv[:2])} reported no peak resident set (it left "
                          "without running its exit handlers)")
    return ChildResult(json.loads(lines[-1]), int(peak_kib) / 1024, wall, started_at)


def measure_prompt(argv: list[str], label: str, *, timeout_s: float = 600) -> dict:
    """One single-prompt measurement: the worker's result for its prompt with the child's peak
    RSS, load and wall time added; a progress line on stderr."""
    child = run_child(argv, timeout_s=timeout_s)
    result = dict(child.payload["results"][0], peak_rss_mb=child.peak_rss_mb,
                  load_s=child.payload["load_s"], wall_s=child.wall_s)
    print(f"{label} ttft {result['ttft_s']:.3f} s  peak {child.peak_rss_mb:.0f} MB",
          file=sys.stderr)
    return result


def write_json(path: Path, data: object) -> None:
    """Write `data` as JSON through a temporary file renamed into place."""
    write_text(path, json.dumps(data, indent=1))


def write_text(path: Path, text: str) -> None:
    """Write `text` through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def publish(out: Path, name: str, data: object, table: str) -> None:
    """A benchmark's results: raw measurements as out/name.json, the table as out/name.md and
    on stdout."""
    write_json(out / f"{name}.json", data)
    write_text(out / f"{name}.md", table + "\n")
    print(table)
