"""scripts/bench_routing.py's report on given turns (the Ray run itself is
tests/serve/test_ray.py's path): per-turn means, replica stickiness, cached totals, and
"not reported" where the server has no cached_tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_routing",
                                                  ROOT / "scripts" / "bench_routing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _turn(prompt, cached, replica):
    return {"prompt_tokens": prompt, "cached_tokens": cached, "replica": replica}


def test_the_report_gives_means_stickiness_and_totals(bench):
    results = {
        "prefix": [[_turn(100, 0, "a"), _turn(300, 100, "a")],
                   [_turn(120, 0, "b"), _turn(320, 120, "b")]],
        "power-of-two": [[_turn(100, 0, "a"), _turn(300, 0, "b")],
                         [_turn(120, 0, "b"), _turn(320, 120, "b")]],
    }
    table = bench.table(results, turns=2)
    assert "| 1 | 110 | 0 | - | 110 | 0 | - |" in table
    assert "| 2 | 310 | 110 | 2/2 | 310 | 60 | 1/2 |" in table
    totals = bench.totals(results)
    assert "prefix: 220 of 840 prompt tokens cached (26.2%)" in totals
    assert "power-of-two: turns per replica [3, 1]" in totals


def test_a_server_without_cached_tokens_is_said_so(bench):
    results = {"prefix": [[_turn(100, None, "a"), _turn(300, None, "a")]]}
    assert "| 2 | 300 | not reported | 1/1 |" in bench.table(results, turns=2)
    assert "cached tokens not reported" in bench.totals(results)


@pytest.mark.parametrize("argv", [["--routings", "random"], ["--chats", "0"],
                                  ["/no/such/model"]])
def test_bad_arguments_are_one_error_line_and_exit_2(bench, argv, capsys):
    assert bench.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: ")
