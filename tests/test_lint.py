"""ruff and mypy on the repository: no new finding anywhere, none at all in the public API.

Findings that predate the checks are recorded per file in tests/lint_baseline.json; a file may
have at most its recorded count (fewer is progress). After fixing findings (or merging
branches) write the smaller counts with

    python tests/test_lint.py --write-baseline

which refuses to raise any count (`--allow-growth` overrides, for a merge that moved code).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "lint_baseline.json"

# The typed public API: mypy finds nothing there, and these never enter the baseline.
PUBLIC = ("onnx_chunk/__init__.py", "onnx_chunk/errors.py", "onnx_chunk/sampling.py",
          "onnx_chunk/serve/app.py", "onnx_chunk/serve/__init__.py",
          "onnx_chunk/text/generation.py", "onnx_chunk/text/conversation.py",
          "onnx_chunk/_onnxruntime_wheels.py")

_MYPY_LINE = re.compile(r"^(?P<path>[^:\s]+\.py):\d+: error: ")


def ruff_counts() -> Counter[str]:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "json",
                           "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    return Counter(Path(item["filename"]).resolve().relative_to(ROOT).as_posix()
                   for item in json.loads(done.stdout))


def mypy_counts() -> Counter[str]:
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                           "--hide-error-context", "--no-pretty"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    counts: Counter[str] = Counter()
    for line in done.stdout.splitlines():
        match = _MYPY_LINE.match(line)
        if match:
            counts[Path(match["path"]).as_posix()] += 1
    assert done.returncode == 0 or counts, done.stdout + done.stderr
    return counts


def _grown(tool: str, counts: Counter[str], baseline: dict[str, dict[str, int]]) -> list[str]:
    allowed = baseline.get(tool, {})
    return [f"{path}: {count} {tool} findings, the baseline allows {allowed.get(path, 0)}"
            for path, count in sorted(counts.items()) if count > allowed.get(path, 0)]


def test_ruff_finds_nothing_new():
    counts = ruff_counts()
    grown = _grown("ruff", counts, json.loads(BASELINE.read_text()))
    assert not grown, ("\n".join(grown) + "\n(see `python -m ruff check .`; "
                       "`python -m ruff check --fix .` fixes most)")


def test_mypy_finds_nothing_new_and_nothing_in_the_public_api():
    counts = mypy_counts()
    public = {path: counts[path] for path in PUBLIC if counts[path]}
    assert not public, f"mypy findings in the public API: {public} (run `python -m mypy`)"
    grown = _grown("mypy", counts, json.loads(BASELINE.read_text()))
    assert not grown, "\n".join(grown) + "\n(run `python -m mypy`)"


def test_the_baseline_lists_no_public_module():
    baseline = json.loads(BASELINE.read_text())
    assert not set(PUBLIC) & set(baseline["mypy"]) and not set(PUBLIC) & set(baseline["ruff"])


def write_baseline(allow_growth: bool) -> None:
    old = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
    new = {"mypy": dict(sorted(mypy_counts().items())),
           "ruff": dict(sorted(ruff_counts().items()))}
    public = [path for path in PUBLIC if path in new["mypy"] or path in new["ruff"]]
    if public:
        sys.exit(f"findings in the public API, fix them first: {public}")
    if old is not None and not allow_growth:
        grown = _grown("mypy", Counter(new["mypy"]), old) + _grown("ruff", Counter(new["ruff"]),
                                                                     old)
        if grown:
            sys.exit("the baseline only shrinks; fix these (or pass --allow-growth):\n"
                     + "\n".join(grown))
    BASELINE.write_text(json.dumps(new, indent=1) + "\n")
    print(f"{BASELINE}: mypy {sum(new['mypy'].values())} in {len(new['mypy'])} files, "
          f"ruff {sum(new['ruff'].values())} in {len(new['ruff'])} files")


if __name__ == "__main__":
    if "--write-baseline" not in sys.argv[1:]:
        sys.exit("usage: python tests/test_lint.py --write-baseline [--allow-growth]")
    write_baseline("--allow-growth" in sys.argv[1:])
