"""Cold start on a builder export: onnx-chunk on the raw folder and the converted one, against
onnxruntime-genai on the raw folder.

Every measurement is a fresh process (`_bench/load_worker.py`): interpreter start, import,
the load call, one greedy generation of `--new-tokens` after a `--prompt`-token prompt; stages
stamped from the spawn. Arms, interleaved round by round in rotating order:
- `raw, first start`: onnx-chunk on the folder as the builder wrote it, with no kept analysis
  (ONNX_CHUNK_ANALYSIS_CACHE=off): what the first start of a new model file pays;
- `raw`: the same folder with the analysis kept by an earlier start (one unrecorded start
  before the rounds fills a cache folder of this run's own): every later start;
- `converted`: the folder after `onnx-chunk convert --chunk-size` (the plan in its metadata);
- `genai`: onnxruntime-genai's `og.Model` on the raw folder (its venv: `--genai-venv`).

Printed: medians with the spread ±(max-min)/median of spawn to first token, spawn to load
returned, import, the load call, peak RSS (the child's own VmHWM), whether onnx / onnx_ir were
imported, and each onnx-chunk arm over genai (under 1 favours onnx-chunk). Goal: spawn to
first token and the load call <= 1.0x genai on `raw` and `converted`.

    .venv/bin/python scripts/bench_cold_start.py [--model qwen05-int4] [--repetitions 5]
        [--prompt 128] [--new-tokens 8] [--chunk-size 512] [--out bench-out]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _bench import environment as env
from _bench.child import ChildFailed, publish, run_child
from _bench.harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
)
from _bench.models import BenchModelMissing

from onnx_chunk.analysis_cache import ENV as ANALYSIS_ENV
from onnx_chunk.analysis_cache import OFF as ANALYSIS_OFF

FIRST, RAW, CONVERTED, GENAI = "raw, first start", "raw", "converted", "genai"
ARMS = (FIRST, RAW, CONVERTED, GENAI)
FIELDS = (("first_token_s", "spawn to first token s", 3),
          ("ready_s", "spawn to load returned s", 3), ("import_s", "import s", 3),
          ("load_s", "load call s", 3), ("peak_rss_mb", "peak RSS MB", 0))


def measure_one(argv: list[str], child_env: dict[str, str]) -> dict:
    child = run_child(argv, timeout_s=600, env=child_env)
    stages = child.payload["stages"]
    return {"first_token_s": stages["first_token"]["at"] - child.started_at,
            "ready_s": stages["ready"]["at"] - child.started_at,
            "import_s": stages["imported"]["at"] - stages["started"]["at"],
            "load_s": stages["ready"]["at"] - stages["imported"]["at"],
            "peak_rss_mb": child.peak_rss_mb, "tokens": child.payload["tokens"],
            "modules": stages["ready"]["modules"], "load_average": os.getloadavg()[0]}


def table(runs: dict[str, list[dict]], header: str) -> str:
    rows = []
    for arm, arm_runs in runs.items():
        rows.append([arm, *(format_value(summarize(run[field] for run in arm_runs), digits)
                            for field, _, digits in FIELDS),
                     " / ".join(sorted({", ".join(run["modules"]) or "neither"
                                        for run in arm_runs}))])
    for arm in (RAW, CONVERTED, FIRST):
        rows.append([f"{arm} / genai", *(
            f"{ratio(summarize(r[field] for r in runs[arm]), summarize(r[field] for r in runs[GENAI])):.2f}x"  # noqa: E501
            for field, _, _ in FIELDS), ""])
    return markdown_table([header, *(title for _, title, _ in FIELDS),
                           "onnx / onnx_ir imported at load returned"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen05-int4",
                        help="a bench model's name or a builder-export folder")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--out", type=Path, default=env.ROOT / "bench-out")
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai")
    args = parser.parse_args(argv)
    for name in ("repetitions", "prompt", "new_tokens", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        name, folder = env.export_folder(args.model)
    except BenchModelMissing as error:
        parser.error(str(error))
    env.compile_package()
    converted = env.converted_export(args.out, name, folder, args.chunk_size)
    cache = args.out / "analysis-cache" / name
    python = {arm: Path(sys.executable) for arm in (FIRST, RAW, CONVERTED)}
    python[GENAI] = env.genai_python(args.genai_venv)
    model = {FIRST: folder / "model.onnx", RAW: folder / "model.onnx", CONVERTED: converted,
             GENAI: folder / "model.onnx"}
    child_env = {arm: dict(os.environ) for arm in ARMS}
    child_env[FIRST][ANALYSIS_ENV] = ANALYSIS_OFF
    child_env[RAW][ANALYSIS_ENV] = str(cache)
    prompt = seeded_prompt(args.prompt, env.model_config(model[RAW])["vocab_size"])

    def command(arm: str) -> list[str]:
        return env.worker_argv(python[arm], "load_worker", {
            "system": "genai" if arm == GENAI else "onnx-chunk", "mode": "load",
            "model": str(model[arm]), "prompt": prompt, "new_tokens": args.new_tokens,
            "chunk_size": args.chunk_size})

    try:
        measure_one(command(RAW), child_env[RAW])  # keeps the analysis for the `raw` arm
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for round_index in range(args.repetitions):
            for arm in round_order(ARMS, round_index):
                run = measure_one(command(arm), child_env[arm])
                runs[arm].append(run)
                print(f"round {round_index + 1}/{args.repetitions} {arm:<17} first token "
                      f"{run['first_token_s']:.3f} s, load {run['load_s']:.3f} s, peak "
                      f"{run['peak_rss_mb']:.0f} MB, load average {run['load_average']:.2f}",
                      file=sys.stderr)
    except ChildFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    loads = [run["load_average"] for arm_runs in runs.values() for run in arm_runs]
    header = (f"{name}, CPU, {args.prompt}-token prompt, {args.new_tokens} new, "
              f"{args.repetitions} rounds, load average {min(loads):.2f}-{max(loads):.2f}")
    text = table(runs, header)
    publish(args.out, f"cold_start_{name}", {"args": {k: str(v) for k, v in vars(args).items()},
                                              "runs": runs}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
