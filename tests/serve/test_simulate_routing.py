"""scripts/simulate_routing.py on a small config: deterministic for a seed, its accounting
holds, and affinity beats power of two choices on prefix hits and TTFT."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def simulation():
    spec = importlib.util.spec_from_file_location("simulate_routing",
                                                  ROOT / "scripts" / "simulate_routing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _small(simulation):
    return simulation.Config(replicas=6, slots=2, conversations=150, rate=0.04, think_s=10.0,
                             max_excess=2, memory=8, seed=3)


def test_the_same_seed_gives_the_same_results_and_another_seed_others(simulation):
    config = _small(simulation)
    first = simulation.run(config, [config.rate])
    assert first == simulation.run(config, [config.rate])
    assert first != simulation.run(replace(config, seed=4), [config.rate])


def test_affinity_reuses_more_and_answers_sooner_than_power_of_two(simulation):
    config = _small(simulation)
    rows = {row["policy"]: row for row in simulation.run(config, [config.rate])}
    power, affinity = rows["power-of-two"], rows["affinity"]
    assert power["requests"] == affinity["requests"] > 100
    assert affinity["hit_rate"] > power["hit_rate"] + 0.3
    assert affinity["later_turns_cached"] > 0.8
    assert affinity["ttft_p50_s"] < power["ttft_p50_s"]


def test_a_shared_system_prompt_spreads_over_the_replicas_and_turns_stay_cached(simulation):
    config = replace(_small(simulation), system_tokens=200)
    rows = {row["policy"]: row for row in simulation.run(config, [config.rate])}
    affinity, power = rows["affinity"], rows["power-of-two"]
    assert affinity["requests_max_over_mean"] < 2.0
    assert affinity["later_turns_cached"] > 0.7
    assert affinity["later_turns_cached"] > power["later_turns_cached"] + 0.4


def test_a_request_reuses_at_most_all_but_its_last_prompt_token(simulation):
    config = replace(_small(simulation), think_s=0.5)
    conversations = simulation.make_trace(config)
    done = []
    original = simulation.admit

    def watched(config, replica, now):
        started = original(config, replica, now)
        done.extend(request for _, (request, _, _) in started)
        return started

    simulation.admit = watched
    try:
        simulation.simulate(config, "affinity", conversations)
    finally:
        simulation.admit = original
    assert len(done) == sum(len(conversation.turns) for conversation in conversations)
    assert all(0 <= request.reused <= request.prompt - 1 for request in done)
    assert any(request.reused == request.prompt - request.conversation.turns[request.turn][0]
               for request in done if request.turn)  # a turn that found its whole history


def test_the_command_prints_the_table_and_writes_json(simulation, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert simulation.main(["--replicas", "4", "--slots", "2", "--conversations", "60",
                            "--rates", "0.05", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 0.05 | affinity |" in printed and "ShareGPT" in printed
    data = json.loads(out.read_text())
    assert [row["policy"] for row in data["results"]] == list(simulation.POLICIES)


@pytest.mark.parametrize("argv", [["--rates", "0"], ["--rates", "x"],
                                  ["--policies", "round-robin"]])
def test_bad_arguments_are_one_error_line_and_exit_2(simulation, argv, capsys):
    assert simulation.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: ")
