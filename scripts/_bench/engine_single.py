"""bench_engine.py's single-request part: --batch 1 of this checkout against a baseline's.

Each measurement is a fresh process (`single_worker`) run by this venv's interpreter with
PYTHONPATH set to one checkout, so it imports that checkout's onnx_chunk (checked: the
child's `onnx_chunk.__file__` must lie under the checkout); the dependencies are this venv's
for both. Both paths of one request are measured: a `Sequence`'s `generate` and
`runtime.submit` with max_batch=1. Trees are interleaved round by round; medians.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import environment as env
from .child import ChildFailed, run_child
from .harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)

CURRENT, BASELINE = "current", "baseline"
PATHS = ("generate", "submit")
# Within 5% of the baseline, or better, unless the plan's `tolerance` says otherwise (issue
# 22's one-session change is held to 3%: --single-tolerance 0.03).
DEFAULT_TOLERANCE = 0.05


def measure(model: Path, baseline: Path, plan: dict, repetitions: int,
            baseline_model: Path | None = None) -> dict:
    """Every run of both trees on both paths: {path: {tree: [result per prompt, ...]}};
    `baseline_model`: the baseline's own conversion of the model (default `model`)."""
    trees = {CURRENT: env.ROOT, BASELINE: baseline.resolve()}
    models = {CURRENT: model, BASELINE: model if baseline_model is None else baseline_model}
    vocab = env.model_config(model)["vocab_size"]
    prompts = [seeded_prompt(length, vocab) for length in plan["prompts"]]
    runs: dict[str, dict[str, list[list[dict]]]] = {path: {tree: [] for tree in trees}
                                                    for path in PATHS}
    for round_index in range(repetitions):
        for path in PATHS:
            for tree in round_order(tuple(trees), round_index):
                results = run_in_checkout(trees[tree], {
                    "model": str(models[tree]), "path": path, "prompts": prompts,
                    "new_tokens": plan["new_tokens"], "chunk_size": plan["chunk"],
                    "capacity": max(plan["prompts"]) + plan["new_tokens"],
                    "repeats": plan["repeats"]})
                runs[path][tree].append(results)
                print(f"round {round_index + 1}/{repetitions} single {path:<8} {tree:<8} ttft "
                      + " ".join(f"{result['ttft_s']:.3f}" for result in results) + " s",
                      file=sys.stderr)
    return {"plan": plan, "baseline": str(trees[BASELINE]),
            "models": {tree: str(path) for tree, path in models.items()}, "runs": runs}


def run_in_checkout(tree: Path, request: dict) -> list[dict]:
    """One single-request child run with the checkout `tree` first on its path: its results;
    ChildFailed when it imported onnx_chunk from anywhere else."""
    child_env = dict(os.environ, PYTHONPATH=str(tree))
    payload = run_child(env.worker_argv(sys.executable, "single_worker", request),
                        timeout_s=1800, env=child_env).payload
    found = Path(payload["onnx_chunk_file"]).resolve()
    if not found.is_relative_to(tree):
        raise ChildFailed(f"the child imported onnx_chunk from {found}, not from the checkout "
                          f"{tree}; check that {tree} holds onnx_chunk/")
    return payload["results"]


def table(data: dict) -> str:
    """TTFT and decode tokens/s per path and prompt length, current against baseline."""
    plan, runs = data["plan"], data["runs"]
    tolerance = plan.get("tolerance", DEFAULT_TOLERANCE)
    ttft_goal, decode_goal = round(1 + tolerance, 4), round(1 - tolerance, 4)
    rows = []
    for path in PATHS:
        current, baseline = runs[path][CURRENT], runs[path][BASELINE]
        for index, length in enumerate(plan["prompts"]):
            row = [path, length]
            for field, digits, goal, higher in (("ttft_s", 3, ttft_goal, False),
                                                ("decode_tokens_per_s", 1, decode_goal, True)):
                ours = summarize(run[index][field] for run in current)
                theirs = summarize(run[index][field] for run in baseline)
                value = ratio(ours, theirs)
                row += [format_value(ours, digits), format_value(theirs, digits),
                        f"{value:.3f}x {verdict(value, goal, higher)}"]
            reference = baseline[0][index]["tokens"]
            row.append("yes" if all(run[index]["tokens"] == reference
                                    for run in current + baseline) else "NO")
            rows.append(row)
    return (f"baseline: {data['baseline']}\n\n" + markdown_table(
        [f"path (one request, {plan['preset']} decoder, CPU, W={plan['chunk']}, "
         f"{plan['new_tokens']} new)", "prompt", "TTFT s current", "TTFT s baseline",
         f"TTFT ratio (goal <= {ttft_goal})", "decode tok/s current", "decode tok/s baseline",
         f"decode ratio (goal >= {decode_goal})", "tokens identical"], rows))
