"""bench_engine.py's memory-and-load part: onnx-chunk against onnxruntime-genai on one model.

Both systems load the same converted model (the reference decoder after `onnx-chunk
convert`, a genai folder) in fresh processes of their own (`load_worker`), systems
interleaved round by round:
- load: from the child's spawn to the first token of one short generation: interpreter
  start, the package's import, the load call, whatever load work the system leaves to its
  first forward (onnx-chunk's CPU session is created there) and the prompt's prefill; the
  same span for both (goal <= 1.0x), also split at the load call's return. The child's peak
  RSS (VmHWM) covers load and the whole generation (goal <= 1.0x);
- import alone: a child that only imports (onnx-chunk: `import onnx_chunk` and
  `onnx_chunk.load`; genai: numpy and onnxruntime_genai): its time, resident set and peak.
Each onnx-chunk child says whether `onnx` or `onnx_ir` were imported by then (a converted
model's load should need neither).
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import environment as env
from .child import ChildResult, run_child
from .harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)

ONNX_CHUNK, GENAI = "onnx-chunk", "genai"
GOAL = 1.0
MODES = ("import", "load")


def measure(model: Path, genai: Path | None, plan: dict, repetitions: int) -> dict:
    """Every run of both modes of both systems: {mode: {system: [run, ...]}}."""
    env.compile_package()
    systems = (ONNX_CHUNK, GENAI) if genai else (ONNX_CHUNK,)
    python = {ONNX_CHUNK: Path(sys.executable)}
    if genai is not None:
        python[GENAI] = genai
    prompt = seeded_prompt(plan["prompt"], env.model_config(model)["vocab_size"])
    runs: dict[str, dict[str, list[dict]]] = {mode: {system: [] for system in systems}
                                              for mode in MODES}
    for round_index in range(repetitions):
        for mode in MODES:
            for system in round_order(systems, round_index):
                child = run_child(env.worker_argv(python[system], "load_worker", {
                    "system": system, "mode": mode, "model": str(model), "prompt": prompt,
                    "new_tokens": plan["new_tokens"], "chunk_size": plan["chunk"]}),
                    timeout_s=600)
                run = _run(child)
                runs[mode][system].append(run)
                print(f"round {round_index + 1}/{repetitions} memory {mode:<6} {system:<10} "
                      f"{run['ready_s' if mode == 'load' else 'import_s']:.3f} s, peak "
                      f"{run['peak_rss_mb']:.0f} MB", file=sys.stderr)
    return {"plan": plan, "runs": runs}


def _run(child: ChildResult) -> dict:
    """One child's stages as seconds (from its spawn and between stages) and MiB."""
    stages = child.payload["stages"]
    run = {"peak_rss_mb": child.peak_rss_mb, "tokens": child.payload["tokens"],
           "startup_s": stages["started"]["at"] - child.started_at,
           "import_s": stages["imported"]["at"] - stages["started"]["at"],
           "rss_started_mb": stages["started"]["rss_mb"],
           "rss_imported_mb": stages["imported"]["rss_mb"],
           "modules": {name: stage["modules"] for name, stage in stages.items()}}
    if "ready" in stages:
        run.update(ready_s=stages["ready"]["at"] - child.started_at,
                   first_token_s=stages["first_token"]["at"] - child.started_at,
                   load_s=stages["ready"]["at"] - stages["imported"]["at"],
                   to_first_token_s=stages["first_token"]["at"] - stages["ready"]["at"],
                   generate_s=stages["generated"]["at"] - stages["ready"]["at"],
                   rss_ready_mb=stages["ready"]["rss_mb"])
    return run


def table(data: dict) -> str:
    """The load table and the import table, with ratio rows when genai ran."""
    plan, runs = data["plan"], data["runs"]
    load, imports = runs["load"], runs["import"]
    load_fields = (("first_token_s", 3), ("ready_s", 3), ("startup_s", 3), ("import_s", 3),
                   ("load_s", 3), ("to_first_token_s", 3), ("generate_s", 3),
                   ("rss_ready_mb", 0), ("peak_rss_mb", 0))
    rows = [[system, *_cells(system_runs, load_fields),
             _modules(system_runs, ("ready", "generated")), _same_tokens(system_runs, load)]
            for system, system_runs in load.items()]
    if GENAI in load:
        rows.append(["onnx-chunk / genai",
                     *_ratios(load, load_fields, {"first_token_s", "peak_rss_mb"}), "", ""])
    first = markdown_table(
        [f"system ({plan['preset']} decoder converted, CPU, {plan['prompt']}-token prompt, "
         f"{plan['new_tokens']} new)", "spawn to first token s", "spawn to load returned s",
         "interpreter start s", "import s", "load call s", "load returned to first token s",
         "generation s (after load)", "RSS at load returned MB",
         "peak RSS MB (load + generation)", "onnx / onnx_ir imported (load returned; end)",
         "tokens = genai"], rows)
    import_fields = (("import_s", 3), ("rss_started_mb", 0), ("rss_imported_mb", 0),
                     ("peak_rss_mb", 0))
    rows = [[system, *_cells(system_runs, import_fields), _modules(system_runs, ("imported",))]
            for system, system_runs in imports.items()]
    if GENAI in imports:
        rows.append(["onnx-chunk / genai", *_ratios(imports, import_fields, set()), ""])
    second = markdown_table(
        ["import alone (onnx-chunk: `import onnx_chunk` + `onnx_chunk.load`; genai: numpy + "
         "onnxruntime_genai)", "import s", "RSS before MB", "RSS after MB", "peak RSS MB",
         "onnx / onnx_ir imported"], rows)
    note = "" if GENAI in load else "\n\ngenai left out (--no-genai): no ratios"
    return f"{first}\n\n{second}{note}"


def _cells(runs: list[dict], fields: tuple) -> list[str]:
    return [format_value(summarize(run[field] for run in runs), digits)
            for field, digits in fields]


def _ratios(by_system: dict, fields: tuple, goals: set) -> list[str]:
    cells = []
    for field, _ in fields:
        value = ratio(summarize(run[field] for run in by_system[ONNX_CHUNK]),
                      summarize(run[field] for run in by_system[GENAI]))
        cells.append(f"{value:.2f}x" + (f" {verdict(value, GOAL, False)}"
                                        if field in goals else ""))
    return cells


def _modules(runs: list[dict], stages: tuple) -> str:
    """The watched modules at each stage, when every run agrees (else each run's)."""
    seen = {"; ".join(", ".join(run["modules"][stage]) or "neither" for stage in stages)
            for run in runs}
    return " / ".join(sorted(seen))


def _same_tokens(runs: list[dict], load: dict) -> str:
    if GENAI not in load:
        return "-"
    reference = load[GENAI][0]["tokens"]
    return "yes" if all(run["tokens"] == reference for run in runs) else "NO"
