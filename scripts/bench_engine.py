"""The batch engine: throughput, decode stall, memory and load, single request, prefill batching.

Throughput: 16 seeded prompts of 40-900 tokens, 64 new tokens each (no EOS stop), on the
`bench` reference decoder, CPU, W = 512: `generate --batch 8` (one batched decode forward of
every running request, prefill chunks interleaved) against `--batch 1` (one request after
another, today's path), and onnxruntime-genai's `og.Engine` (static batching, 8 rows) from the
peer venv where it runs. Tokens/s over the generation's wall time (load and a one-prompt
warm-up excluded); goal >= 3x.

Stall: 3 requests decoding while a 4000-token prompt is admitted; the longest gap between two
tokens of a running request during the admission, chunked (W = 512: one chunk per step)
against whole-prompt admission (W >= the prompt: one forward); goal: the chunked gap under
1.5x one chunk's forward (the longest prefill forward of that prompt run alone).

Memory and load (`_bench/engine_memory.py`): peak RSS and load time of onnx-chunk against
onnxruntime-genai on the converted bench decoder, a fresh process per measurement (load
time: from the spawn to the first token of a 40-token prompt, the same span for both); and
the import alone. Goal <= 1.0x both.

Single request (`_bench/engine_single.py`, needs `--baseline PATH`, another checkout of this
repository, which converts the model with its own `convert`): TTFT and decode tokens/s of one
request (`Sequence.generate`, and `submit` with max_batch=1) of this checkout against the
baseline's, prompts of 40, 512 and 900 tokens, 64
new, each run 3 times in a row per process (medians); goal: within 5% (TTFT ratio <= 1.05,
decode ratio >= 0.95), or within `--single-tolerance` (the one-session change is held to 0.03).

Prefill batching (`_bench/engine_prefill.py`): plain ONNX Runtime on the converted decoder,
one [2, 512] forward against two [1, 512], [8, 40] against eight [1, 40], with the FLOPs
and GFLOP/s of each forward and of the throughput part's phases.

Each measurement runs in a process of its own (the probe: one process); systems are
interleaved round by round and reported as medians. `--part` picks parts (repeatable;
default all); each part writes bench-out/engine_<part>.md and .json. `--quick` is a smoke
run of every part on the tiny decoder (CI). `--mix decode-heavy` runs the throughput part on
16 prompts of 100-300 tokens with 256 new tokens each (files suffixed _decode_heavy).

    .venv/bin/python scripts/bench_engine.py [--quick] [--repetitions 3] [--no-genai]
        [--part throughput|stall|memory|single|prefill-batching ...] [--baseline PATH]
        [--single-tolerance 0.05] [--mix prefill-heavy|decode-heavy]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _bench import engine_memory, engine_prefill, engine_single
from _bench import environment as env
from _bench.child import ChildFailed, publish, run_child
from _bench.harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)

from onnx_chunk.models.config import config_for

BATCHED, ONE, GENAI = "batched", "batch 1", "genai og.Engine"
STALL_SYSTEMS = ("chunked", "whole")
PARTS = ("throughput", "stall", "memory", "single", "prefill-batching")
FULL: dict[str, Any] = {
        "preset": "bench", "count": 16, "shortest": 40, "longest": 900, "new_tokens": 64,
        "chunk": 512, "long": 4000, "capacity": 4096, "batch": 8, "running": 40,
        "memory": {"prompt": 40, "new_tokens": 8},
        "single": {"prompts": [40, 512, 900], "new_tokens": 64, "repeats": 3},
        "probe": {"cases": [[2, 512], [8, 40]], "decode_past": 512}}
QUICK: dict[str, Any] = {
         "preset": "tiny", "count": 6, "shortest": 10, "longest": 120, "new_tokens": 8,
         "chunk": 32, "long": 300, "capacity": 512, "batch": 4, "running": 10,
         "memory": {"prompt": 10, "new_tokens": 4},
         "single": {"prompts": [10, 60], "new_tokens": 8, "repeats": 1},
         "probe": {"cases": [[2, 32], [4, 10]], "decode_past": 32}}
# --mix decode-heavy: the throughput part on prompts of 100-300 tokens with 256 new tokens each,
# where the batched decode, not the prefill, carries the work.
DECODE_HEAVY: dict[str, Any] = {"shortest": 100, "longest": 300, "new_tokens": 256}
THROUGHPUT_GOAL = 3.0
STALL_GOAL = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0], variant=False)
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai",
                        help="venv holding onnxruntime-genai (created when missing)")
    parser.add_argument("--no-genai", action="store_true",
                        help="leave onnxruntime-genai out (og.Engine and the memory part's "
                             "genai rows)")
    parser.add_argument("--mix", choices=("prefill-heavy", "decode-heavy"),
                        default="prefill-heavy",
                        help="the throughput part's workload: prompts of 40-900 tokens and 64 "
                             "new (default), or of 100-300 tokens and 256 new")
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="run this part (repeatable; default every part)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of this repository for the single-request part "
                             "(its onnx_chunk is imported through PYTHONPATH); without it "
                             "that part is skipped")
    parser.add_argument("--single-tolerance", type=float, default=engine_single.DEFAULT_TOLERANCE,
                        help="the single-request part's goal: TTFT and decode within this "
                             "fraction of the baseline's")
    args = parser.parse_args(argv)
    if not 0 < args.single_tolerance < 1:
        parser.error(f"--single-tolerance must be between 0 and 1, got {args.single_tolerance}")
    if args.model is not None and "prefill-batching" in (args.part or ()):
        parser.error("--part prefill-batching counts a reference decoder's FLOPs; it does not "
                     "run with --model")
    default_parts = PARTS if args.model is None else tuple(
        part for part in PARTS if part != "prefill-batching")
    if args.model is not None and args.part is None:
        print("prefill-batching part left out: it counts a reference decoder's FLOPs, and "
              "--model names another model", file=sys.stderr)
    parts = tuple(part for part in PARTS if part in (args.part or default_parts))
    if args.baseline is not None and not (args.baseline / "onnx_chunk" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline} holds no onnx_chunk/__init__.py; pass a "
                     "checkout of this repository (git worktree add PATH COMMIT)")
    plan = QUICK if args.quick else FULL
    if args.model is not None:
        plan = dict(plan, preset=env.named_export(args.model)[0])
    if args.mix == "decode-heavy" and not args.quick:
        plan = {**plan, **DECODE_HEAVY}
    repetitions = 1 if args.quick else args.repetitions
    suffix = ("_quick" if args.quick else "") + ("_decode_heavy" if args.mix == "decode-heavy"
                                                  else "")
    genai = None if args.no_genai else env.genai_python(args.genai_venv)
    tables = []

    throughput: dict[str, list[dict]] = {}
    if "throughput" in parts or "stall" in parts:
        model = (env.build_model(args.out, plan["preset"]) if args.model is None
                 else env.source_model(args, plan["preset"]))
        vocab = env.model_config(model)["vocab_size"]
        prompts = [seeded_prompt(length, vocab) for length in _lengths(plan)]
        systems = (BATCHED, ONE, GENAI) if genai else (BATCHED, ONE)
        stall: dict[str, list[dict]] = {}
        for round_index in range(repetitions):
            if "throughput" in parts:
                for system in round_order(systems, round_index):
                    result = _throughput(system, model, prompts, plan, genai)
                    throughput.setdefault(system, []).append(result)
                    print(f"round {round_index + 1}/{repetitions} throughput {system:<15} "
                          f"{result.get('tokens_per_s', 0):.1f} tok/s {result.get('error', '')}",
                          file=sys.stderr)
            if "stall" in parts:
                for system in round_order(STALL_SYSTEMS, round_index):
                    result = _stall(system, model, plan, vocab)
                    stall.setdefault(system, []).append(result)
                    print(f"round {round_index + 1}/{repetitions} stall {system:<8} longest "
                          f"gap {result['longest_gap_s']:.3f} s, chunk forward "
                          f"{result['chunk_forward_s']:.3f} s", file=sys.stderr)
        if "throughput" in parts:
            tables.append(_publish(args.out, f"engine_throughput{suffix}", {
                "plan": plan, "repetitions": repetitions, "throughput": throughput},
                _throughput_table(throughput, plan)))
        if "stall" in parts:
            tables.append(_publish(args.out, f"engine_stall{suffix}", {
                "plan": plan, "repetitions": repetitions, "stall": stall},
                _stall_table(stall, plan)))

    converted = ((env.converted_model(args.out, plan["preset"]) if args.model is None
                  else env.served_model(args, plan["preset"], plan["chunk"]))
                 if {"memory", "single", "prefill-batching"} & set(parts) else None)
    if "memory" in parts:
        assert converted is not None
        data = engine_memory.measure(converted, genai, {
            "preset": plan["preset"], "chunk": plan["chunk"], **plan["memory"]}, repetitions)
        tables.append(_publish(args.out, f"engine_memory{suffix}", data,
                               engine_memory.table(data)))
    if "single" in parts:
        if args.baseline is None:
            skipped = ("single-request part skipped: no --baseline PATH (a checkout of this "
                       "repository to compare with, e.g. `git worktree add PATH COMMIT`)")
            print(skipped)
            tables.append(skipped)
        else:
            assert converted is not None
            # Each tree runs its own conversion of the same source model.
            source = (env.build_model(args.out, plan["preset"]) if args.model is None
                      else env.named_export(args.model)[1] / "model.onnx")
            baseline_model = env.converted_by(args.baseline, source, args.out, plan["chunk"])
            data = engine_single.measure(converted, args.baseline, {
                "preset": plan["preset"], "chunk": plan["chunk"], **plan["single"],
                "tolerance": args.single_tolerance}, repetitions, baseline_model)
            tables.append(_publish(args.out, f"engine_single{suffix}", data,
                                   engine_single.table(data)))
    if "prefill-batching" in parts:
        config = config_for(plan["preset"])
        assert converted is not None
        data = engine_prefill.measure(converted, {"preset": plan["preset"], **plan["probe"]},
                                      repetitions)
        phases = engine_prefill.throughput_phases(
            throughput, _lengths(plan), plan["new_tokens"], config)
        tables.append(_publish(args.out, f"engine_prefill_batching{suffix}", data,
                               engine_prefill.table(data, config, phases)))
    return 0


def _publish(out: Path, name: str, data: dict, table: str) -> str:
    publish(out, name, data, table)
    return table


def _lengths(plan: dict) -> list[int]:
    """The throughput part's prompt lengths: `count`, evenly spaced from shortest to longest."""
    step = (plan["longest"] - plan["shortest"]) / (plan["count"] - 1)
    return [round(plan["shortest"] + index * step) for index in range(plan["count"])]


def _stall(system: str, model: Path, plan: dict, vocab: int) -> dict:
    return run_child(env.worker_argv(sys.executable, "engine_worker", {
        "model": str(model), "mode": "stall", "batch": 4,
        "chunk_size": plan["chunk"] if system == "chunked" else plan["capacity"],
        "capacity": plan["capacity"], "running": plan["running"],
        "long": seeded_prompt(plan["long"], vocab, seed=1)}), timeout_s=1800).payload


def _throughput(system: str, model: Path, prompts: list, plan: dict,
                genai: Path | None) -> dict:
    new_tokens = plan["new_tokens"]
    if system == GENAI:
        assert genai is not None  # GENAI is measured only with a genai venv
        argv = env.worker_argv(genai, "genai_engine_worker", {
            "model": str(model.parent), "prompts": prompts, "new_tokens": new_tokens,
            "batch": plan["batch"]})
    else:
        argv = env.worker_argv(sys.executable, "engine_worker", {
            "model": str(model), "mode": "throughput", "prompts": prompts,
            "new_tokens": new_tokens, "chunk_size": plan["chunk"],
            "capacity": plan["longest"] + new_tokens,
            "batch": plan["batch"] if system == BATCHED else 1})
    try:
        payload = run_child(argv, timeout_s=3600).payload
    except ChildFailed as error:
        return {"error": str(error).splitlines()[0]}
    if "error" in payload:
        return payload
    return {**payload, "tokens_per_s": len(prompts) * new_tokens / payload["wall_s"]}


def _throughput_table(throughput: dict, plan: dict) -> str:
    base = summarize(run["tokens_per_s"] for run in throughput[ONE])
    base_decode = summarize(len(run["tokens"]) * (plan["new_tokens"] - 1) / run["decode_s"]
                            for run in throughput[ONE])
    reference = throughput[ONE][0]["tokens"]
    rows = []
    for system, runs in throughput.items():
        failed = [run["error"] for run in runs if "error" in run]
        if failed:
            rows.append([system, f"refused: {failed[0]}", *["-"] * 6])
            continue
        speed = summarize(run["tokens_per_s"] for run in runs)
        value = ratio(speed, base)
        same = all(run["tokens"] == reference for run in runs)
        goal = (f"{value:.2f}x {verdict(value, THROUGHPUT_GOAL, True)}" if system == BATCHED
                else f"{value:.2f}x")
        rows_per_step = runs[0].get("rows_per_decode_step")
        label = system if system == ONE else f"{system} (batch {plan['batch']})"
        phases = ["-", "-", "-"]
        if "decode_s" in runs[0]:
            prefill = summarize(run["prefill_s"] for run in runs)
            decode = summarize(run["decode_s"] for run in runs)
            decode_speed = summarize(len(run["tokens"]) * (plan["new_tokens"] - 1)
                                     / run["decode_s"] for run in runs)
            phases = [format_value(prefill, 2), format_value(decode, 2),
                      f"{ratio(decode_speed, base_decode):.2f}x"]
        rows.append([label, format_value(speed, 1), goal, *phases,
                     "-" if rows_per_step is None else f"{rows_per_step:.2f}",
                     "yes" if same else "NO"])
    return markdown_table(
        [f"system ({plan['count']} prompts {plan['shortest']}-{plan['longest']} tokens, "
         f"{plan['new_tokens']} new, {plan['preset']} decoder, CPU, W={plan['chunk']})",
         "tokens/s", "vs batch 1", "prefill s", "decode s", "decode tokens/s vs batch 1",
         "rows per decode step", "tokens = batch 1"], rows)


def _stall_table(stall: dict, plan: dict) -> str:
    stall_rows = []
    for system in STALL_SYSTEMS:
        runs = stall[system]
        gap = summarize(run["longest_gap_s"] for run in runs)
        chunk = summarize(run["chunk_forward_s"] for run in runs)
        value = ratio(gap, chunk)
        stall_rows.append([system, format_value(gap, 3), format_value(chunk, 3),
                           f"{value:.2f}x" + (f" {verdict(value, STALL_GOAL, False)}"
                                              if system == "chunked" else ""),
                           runs[0]["chunks"]])
    chunked = summarize(run["longest_gap_s"] for run in stall["chunked"])
    whole = summarize(run["longest_gap_s"] for run in stall["whole"])
    second = markdown_table(
        [f"admission of a {plan['long']}-token prompt beside 3 decoding requests",
         "longest token gap s", "one chunk's forward s", "gap / chunk forward",
         "chunks of the prompt"], stall_rows)
    return (f"{second}\n\nwhole-prompt admission stalls running decodes "
            f"{ratio(whole, chunked):.1f}x longer than chunked admission")


if __name__ == "__main__":
    sys.exit(main())
