"""ruff and mypy on the repository (onnx_chunk/ and scripts/): the findings only ever shrink.

Findings that predate the checks are recorded per file in tests/lint_baseline.json. The tests
fail when

1. any file has more findings than its recorded count (a new finding, wherever it is);
2. any file has fewer findings than its recorded count (fixed findings are recorded at once, so
   the freed room cannot be filled by a new finding later);
3. the typed public API (PUBLIC) has any finding, or appears in the baseline.

After fixing findings, or after a merge, record the counts with

    python tests/test_lint.py --write-baseline

It refuses to write a baseline whose total, per tool, is above the committed one; a file's count
may rise only when the total does not (a merge or a refactor that moved code, and its findings,
from one file into another): then it writes, and names the files whose count rose, for the
reviewer to check that the move explains them. There is no option to record a larger total.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

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


def _shrunk(tool: str, counts: Counter[str], baseline: dict[str, dict[str, int]]) -> list[str]:
    return [f"{path}: {counts[path]} {tool} findings, the baseline records {recorded}"
            for path, recorded in sorted(baseline.get(tool, {}).items())
            if counts[path] < recorded]


_HINT = {"ruff": "(see `python -m ruff check .`; `python -m ruff check --fix .` fixes most)",
         "mypy": "(run `python -m mypy`)"}


def _check(tool: str, counts: Counter[str]) -> None:
    baseline = json.loads(BASELINE.read_text())
    grown = _grown(tool, counts, baseline)
    assert not grown, "\n".join(grown) + "\n" + _HINT[tool]
    shrunk = _shrunk(tool, counts, baseline)
    assert not shrunk, ("\n".join(shrunk) + "\nfewer findings than recorded: record them with "
                        "`python tests/test_lint.py --write-baseline`")


def test_ruff_counts_match_the_baseline():
    _check("ruff", ruff_counts())


def test_mypy_counts_match_the_baseline_and_the_public_api_has_none():
    counts = mypy_counts()
    public = {path: counts[path] for path in PUBLIC if counts[path]}
    assert not public, f"mypy findings in the public API: {public} (run `python -m mypy`)"
    _check("mypy", counts)


def test_the_baseline_lists_no_public_module():
    baseline = json.loads(BASELINE.read_text())
    assert not set(PUBLIC) & set(baseline["mypy"]) and not set(PUBLIC) & set(baseline["ruff"])


def moves(old: dict[str, dict[str, int]], new: dict[str, dict[str, int]]) -> list[str]:
    """The files whose count rose from `old` to `new`; SystemExit when a tool's total rose."""
    rose = []
    for tool in ("mypy", "ruff"):
        before, after = sum(old.get(tool, {}).values()), sum(new[tool].values())
        grown = _grown(tool, Counter(new[tool]), old)
        if after > before:
            sys.exit(f"the baseline only shrinks: {tool} total {after} > {before}; fix these:\n"
                     + "\n".join(grown))
        rose += grown
    return rose


def test_a_move_keeps_the_total_and_growth_is_refused():
    old = {"mypy": {"a.py": 3, "b.py": 1}, "ruff": {}}
    assert moves(old, {"mypy": {"a.py": 1, "b.py": 3}, "ruff": {}}) == [
        "b.py: 3 mypy findings, the baseline allows 1"]
    assert moves(old, {"mypy": {"a.py": 2}, "ruff": {}}) == []
    for grown in ({"mypy": {"a.py": 3, "b.py": 2}, "ruff": {}},
                  {"mypy": {"a.py": 3, "b.py": 1}, "ruff": {"c.py": 1}}):
        with pytest.raises(SystemExit, match="only shrinks"):
            moves(old, grown)


def write_baseline() -> None:
    new = {"mypy": dict(sorted(mypy_counts().items())),
           "ruff": dict(sorted(ruff_counts().items()))}
    public = [path for path in PUBLIC if path in new["mypy"] or path in new["ruff"]]
    if public:
        sys.exit(f"findings in the public API, fix them first: {public}")
    rose = moves(json.loads(BASELINE.read_text()), new)
    BASELINE.write_text(json.dumps(new, indent=1) + "\n")
    for line in rose:
        print(f"moved here (the total did not grow): {line}", file=sys.stderr)
    print(f"{BASELINE}: mypy {sum(new['mypy'].values())} in {len(new['mypy'])} files, "
          f"ruff {sum(new['ruff'].values())} in {len(new['ruff'])} files")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-baseline"]:
        sys.exit("usage: python tests/test_lint.py --write-baseline")
    write_baseline()
