"""llama.cpp as the CPU anchor: onnx-chunk, onnxruntime-genai, a bare ORT loop and llama.cpp.

One builder export (``--model qwen05-int4``, see scripts/make_bench_models.py; or a folder) and
the GGUF files of the same random-weight checkpoint (``--gguf``, default the shape's Q4_0 and
Q8_0 when built) run side by side on the CPU with the same threads, the same seeded prompt ids,
the same new tokens (no EOS stop where the runtime allows it; genai stops at EOS, which random
weights rarely emit) and the same prefill chunk width:

* onnx-chunk: the export after `onnx-chunk convert --chunk-size W` (what it serves: a CPU
  export's layers as int8 matmuls, convert's default);
* genai: onnxruntime-genai 0.18's og.Generator on the export as the builder wrote it, with
  search.chunk_size W (genai venv);
* ort-loop: a bare ONNX Runtime IOBinding loop over the same export, W rows per prefill forward
  (`_bench/ort_loop_worker.py`): the floor a runtime on ONNX Runtime can reach;
* llama.cpp Q4_0 / Q8_0: llama-cpp-python's C API (n_batch = n_ubatch = W), in its own venv
  (``--llama-python``; default the scratch venv of `_bench/venvs.py`, made on first use);
* with ``--int4-block-size N``, also "onnx-chunk bN": the export converted with
  `--int4-block-size N` (its 4-bit weights re-blocked, a second quantization); with
  ``--int8-matmul``, also "onnx-chunk int8": converted with `--int8-matmul` (the layers' weights
  int8 for ONNX Runtime's QGEMM); with ``--no-int8-matmul``, also "onnx-chunk 4-bit": the
  builder's 4-bit MatMulNBits kept; each with a table of its own ratios to every system and how
  many leading tokens equal onnx-chunk's.

Every measurement is a fresh process (peak RSS is its own VmHWM); systems are interleaved round
by round, medians with their spread ((max-min)/median), the 1-minute load average before every
measurement. Ratios are onnx-chunk's over each system's: TTFT and peak RSS under 1 and decode
tokens/s over 1 favour onnx-chunk. The weights differ across runtimes (docs/benchmarks.md,
part 7, gives the detail): the INT4 export holds every matrix, the tied embedding and lm_head
included, as 4-bit blocks of 32 (MatMulNBits, accuracy level 4); Q4_0 holds the layers' matrices
as 4-bit blocks of 32 but the tied embedding/output at Q8_0; Q8_0 is 8-bit blocks of 32. So
speed and memory are compared, tokens are not.

Every runtime keeps its own thread-pool defaults, spin-waiting included, as a user gets them:
measure on a quiet machine. On a loaded one the spinning distorts every system, llama.cpp's most
(its threads are OpenMP's): at load average 9-14 on 2 cores, Q4_0 decode ran 1.0 tok/s with
OpenMP's default active wait and 20 tok/s with OMP_WAIT_POLICY=PASSIVE, and the bare ORT loop
10 tok/s with ORT's default spinning and 17.5 with `session.intra_op.allow_spinning` 0.
`--omp-wait-policy passive` sets OMP_WAIT_POLICY for every child (only llama.cpp uses OpenMP);
onnx-chunk's `load` offers no switch for ORT's spinning, so that is not a like-for-like fix.
Without the llama.cpp venv or GGUF files the llama.cpp rows are left out, and the output says
so at its top.

`--sequences 1,8` adds the batched part: S users at once. onnx-chunk serves S seeded prompts of
`--batch-prompt` tokens through its batch engine (`max_batch` S, `_bench/engine_worker.py`'s
throughput mode: one decode forward of every running request per step); llama.cpp decodes S
sequences in one `llama_batch` per step (`_bench/llamacpp_batch_worker.py`: a cache stream per
sequence). Both produce `--new-tokens` tokens per prompt without an EOS stop; the table gives
tokens/s over the whole generation (prefill included) and over the decode phase (S x (new - 1)
tokens over the time after the last prompt's first token), and each system's rate at S over
its rate at 1.

    .venv/bin/python scripts/bench_vs_llamacpp.py --model qwen05-int4 [--lengths 128,1000]
        [--new-tokens 64] [--repetitions 3] [--threads 2] [--chunk-size 512] [--quick]
        [--sequences 1,8 [--batch-prompt 128] [--only-batched]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _bench import environment as env
from _bench import venvs
from _bench.child import measure_prompt, publish, run_child
from _bench.harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
)
from _bench.models import BenchModelMissing, bench_model, gguf_twins

OURS, GENAI, ORT_LOOP = "onnx-chunk", "genai", "ort-loop"
FIELDS = (("ttft_s", "TTFT s", 3, False), ("decode_tokens_per_s", "decode tok/s", 1, True),
          ("peak_rss_mb", "peak RSS MB", 0, False))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="benchmark model name (qwen05-int4, ...) or a builder-export folder")
    parser.add_argument("--gguf", action="append", default=None,
                        help="GGUF model names or .gguf files for llama.cpp (repeatable; default "
                             "the shape's q4_0 and q8_0 when built)")
    parser.add_argument("--models-root", type=Path, default=None,
                        help="benchmark model cache (default $ONNX_CHUNK_BENCH_MODELS or "
                             "~/.cache/onnx-chunk/bench-models)")
    parser.add_argument("--out", type=Path, default=env.DEFAULT_OUT,
                        help="folder for converted models, JSON results and tables")
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai")
    parser.add_argument("--llama-python", type=Path, default=None,
                        help="interpreter of a llama-cpp-python venv (default "
                             "$ONNX_CHUNK_LLAMACPP_PYTHON, else the scratch venv under the "
                             "user's cache, made on first use)")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--int4-block-size", type=int, choices=(32, 64, 128, 256), default=None,
                        help="also measure the export converted with --int4-block-size N")
    parser.add_argument("--int8-matmul", action="store_true",
                        help="also measure the export converted with --int8-matmul")
    parser.add_argument("--no-int8-matmul", action="store_true",
                        help="also measure the export converted with --no-int8-matmul (its "
                             "4-bit weights kept; the default rewrites a CPU export's)")
    parser.add_argument("--omp-wait-policy", choices=("passive", "active", "unset"),
                        default="unset",
                        help="OMP_WAIT_POLICY for every child (llama.cpp's threads are OpenMP's; "
                             "default unset: OpenMP's own; see the module's docstring)")
    parser.add_argument("--sequences", default=None,
                        help="comma-separated counts of users at once for the batched part "
                             "(for example 1,8); default: no batched part")
    parser.add_argument("--batch-prompt", type=int, default=128,
                        help="prompt length of each sequence in the batched part")
    parser.add_argument("--only-batched", action="store_true",
                        help="run the batched part alone (needs --sequences)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 short prompts, 1 round, 8 new tokens")
    return parser


def _gguf_systems(args: argparse.Namespace, name: str) -> tuple[dict[str, Path], str | None]:
    """{system: .gguf path} for llama.cpp, and why llama.cpp is left out (None when it runs).
    Sets args.llama_python when GGUF files are found: --llama-python, else the scratch venv's
    interpreter (made on first use)."""
    if args.llama_python is not None and not args.llama_python.exists():
        return {}, (f"llama.cpp LEFT OUT: no llama-cpp-python interpreter at {args.llama_python} "
                    f"(--llama-python; `{venvs.LLAMACPP.command()}` makes one)")
    try:
        wanted = args.gguf if args.gguf is not None else gguf_twins(name)
    except BenchModelMissing:
        return {}, (f"llama.cpp LEFT OUT: {name} is not a benchmark model name, so it has no "
                    "GGUF twin; pass --gguf FILE")
    found, missing = {}, []
    for value in wanted:
        try:
            path = Path(value) if value.endswith(".gguf") else bench_model(value,
                                                                          args.models_root)
        except BenchModelMissing as error:
            missing.append(str(error))
            continue
        found[f"llama.cpp {path.stem.rpartition('-')[2]}"] = path
    if not found:
        return {}, "llama.cpp LEFT OUT: " + "; ".join(missing)
    if args.llama_python is None:
        args.llama_python = env.llama_python(make=True)
    return found, ("llama.cpp partly left out: " + "; ".join(missing)) if missing else None


def _argv(system: str, args, paths: dict, prompt: list[int], new_tokens: int) -> list[str]:
    common = {"prompts": [prompt], "new_tokens": new_tokens, "chunk_size": args.chunk_size}
    if system.startswith(OURS):
        return env.worker_argv(sys.executable, "chunk_worker", dict(
            common, model=str(paths[system]), eos=[], capacity=len(prompt) + new_tokens,
            threads=args.threads))
    if system == GENAI:
        return env.worker_argv(paths["genai_python"], "genai_worker", dict(
            common, model=str(paths["export"]), threads=args.threads))
    if system == ORT_LOOP:
        return env.worker_argv(sys.executable, "ort_loop_worker", dict(
            common, model=str(paths["export"]), threads=args.threads))
    return env.worker_argv(args.llama_python, "llamacpp_worker", dict(
        common, model=str(paths[system]), threads=args.threads))


def _table(systems: list[str], lengths: list[int], runs: dict, reference: str = OURS) -> str:
    """Each system's medians and `reference`'s ratios to them; for an onnx-chunk arm other than
    onnx-chunk's own, also its leading tokens equal to onnx-chunk's (fewest over the runs)."""
    rows = []
    for length in lengths:
        ours = runs[(length, reference)]
        for system in systems:
            theirs = runs[(length, system)]
            row: list[object] = [length, system]
            for field, _, digits, _ in FIELDS:
                row.append(format_value(summarize(run[field] for run in theirs), digits))
            for field, _, _, _ in FIELDS:
                value = ratio(summarize(run[field] for run in ours),
                              summarize(run[field] for run in theirs))
                row.append("-" if system == reference else f"{value:.2f}x")
            row.append(min(len(run["tokens"]) for run in theirs))
            if reference != OURS:
                row.append(min(_leading_equal(run["tokens"], base["tokens"])
                               for run in theirs for base in runs[(length, OURS)]))
            rows.append(row)
    return markdown_table(
        ["prompt", "system", *(label for _, label, _, _ in FIELDS),
         *(f"{reference} / this, {label}" for _, label, _, _ in FIELDS), "new tokens (min)",
         *([] if reference == OURS else ["leading tokens = onnx-chunk's"])], rows)


def _leading_equal(tokens: list[int], reference: list[int]) -> int:
    return next((index for index, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                min(len(tokens), len(reference)))


BATCHED_FIELDS = (("tokens_per_s", "tok/s (all)"), ("decode_tokens_per_s", "decode tok/s"))


def _sequence_counts(text: str | None) -> list[int]:
    if text is None:
        return []
    counts = [int(value) for value in text.split(",")]
    if not counts or min(counts) < 1:
        raise SystemExit(f"error: --sequences takes positive counts, got {text!r}")
    return counts


def _batched_run(system: str, args, paths: dict, prompts: list[list[int]],
                 new_tokens: int) -> dict:
    """One measurement of the batched part: `system` generating `new_tokens` for every prompt
    at once; its rates added to the worker's result."""
    common = {"prompts": prompts, "new_tokens": new_tokens, "chunk_size": args.chunk_size,
              "threads": args.threads}
    if system.startswith(OURS):
        argv = env.worker_argv(sys.executable, "engine_worker", dict(
            common, model=str(paths[system]), mode="throughput", batch=len(prompts),
            capacity=max(len(prompt) for prompt in prompts) + new_tokens))
    else:
        argv = env.worker_argv(args.llama_python, "llamacpp_batch_worker", dict(
            common, model=str(paths[system])))
    child = run_child(argv, timeout_s=3600)
    result = dict(child.payload, peak_rss_mb=child.peak_rss_mb)
    result["tokens_per_s"] = len(prompts) * new_tokens / result["wall_s"]
    result["decode_tokens_per_s"] = len(prompts) * (new_tokens - 1) / result["decode_s"]
    print(f"{len(prompts)} sequences {system:<15} {result['tokens_per_s']:.1f} tok/s, decode "
          f"{result['decode_tokens_per_s']:.1f} tok/s, peak {child.peak_rss_mb:.0f} MB",
          file=sys.stderr)
    return result


def _batched_table(systems: list[str], counts: list[int], runs: dict) -> str:
    """Per sequence count and system: the rates' medians, onnx-chunk's over each system's, and
    each system's rate at that count over its own at the first count."""
    rows = []
    for count in counts:
        for system in systems:
            theirs = runs[(count, system)]
            row: list[object] = [count, system]
            for field, _ in BATCHED_FIELDS:
                row.append(format_value(summarize(run[field] for run in theirs), 1))
            for field, _ in BATCHED_FIELDS:
                value = ratio(summarize(run[field] for run in runs[(count, OURS)]),
                              summarize(run[field] for run in theirs))
                row.append("-" if system == OURS else f"{value:.2f}x")
            for field, _ in BATCHED_FIELDS:
                value = ratio(summarize(run[field] for run in theirs),
                              summarize(run[field] for run in runs[(counts[0], system)]))
                row.append(f"{value:.2f}x")
            row.append(format_value(summarize(run["peak_rss_mb"] for run in theirs), 0))
            rows.append(row)
    return markdown_table(
        ["sequences", "system", *(label for _, label in BATCHED_FIELDS),
         *(f"onnx-chunk / this, {label}" for _, label in BATCHED_FIELDS),
         *(f"this at S / at {counts[0]}, {label}" for _, label in BATCHED_FIELDS),
         "peak RSS MB"], rows)


def _batched(args, paths: dict, systems: list[str], counts: list[int], vocab: int,
             new_tokens: int, repetitions: int, loads: list[float]) -> dict:
    runs: dict[tuple[int, str], list[dict]] = {}
    for round_index in range(repetitions):
        for count in counts:
            prompts = [seeded_prompt(args.batch_prompt, vocab, seed=index)
                       for index in range(count)]
            for system in round_order(systems, round_index):
                loads.append(os.getloadavg()[0])
                runs.setdefault((count, system), []).append(dict(
                    _batched_run(system, args, paths, prompts, new_tokens), load_1m=loads[-1]))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        name, folder = env.export_folder(args.model, args.models_root)
    except BenchModelMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    counts = _sequence_counts(args.sequences)
    if args.only_batched and not counts:
        print("error: --only-batched needs --sequences", file=sys.stderr)
        return 2
    repetitions, new_tokens = (1, 8) if args.quick else (args.repetitions, args.new_tokens or 64)
    lengths = ([] if args.only_batched
               else [int(value) for value in args.lengths.split(",")] if args.lengths
               else [40, 300] if args.quick else [128, 1000])
    if args.omp_wait_policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    ggufs, left_out = _gguf_systems(args, name)
    if left_out:
        print(f"\n*** {left_out} ***\n", file=sys.stderr)
    paths: dict = {"export": folder, OURS: env.converted_export(args.out, name, folder,
                                                               args.chunk_size), **ggufs}
    if lengths:
        paths["genai_python"] = env.genai_python(args.genai_venv)
    arms = []  # the other conversions measured beside the plain one
    if args.int4_block_size is not None:
        arms.append(f"{OURS} b{args.int4_block_size}")
        paths[arms[-1]] = env.converted_export(args.out, name, folder, args.chunk_size,
                                               int4_block_size=args.int4_block_size)
    if args.int8_matmul:
        arms.append(f"{OURS} int8")
        paths[arms[-1]] = env.converted_export(args.out, name, folder, args.chunk_size,
                                               int8_matmul=True)
    if args.no_int8_matmul:
        arms.append(f"{OURS} 4-bit")
        paths[arms[-1]] = env.converted_export(args.out, name, folder, args.chunk_size,
                                               int8_matmul=False)
    systems = [OURS, *arms, GENAI, ORT_LOOP, *ggufs]
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    runs: dict[tuple[int, str], list[dict]] = {}
    loads: list[float] = []
    for round_index in range(repetitions):
        for length in lengths:
            prompt = seeded_prompt(length, vocab)
            for system in round_order(systems, round_index):
                loads.append(os.getloadavg()[0])
                result = measure_prompt(_argv(system, args, paths, prompt, new_tokens),
                                        f"round {round_index + 1}/{repetitions} {length:>5} "
                                        f"tokens {system:<15}")
                runs.setdefault((length, system), []).append(dict(result, load_1m=loads[-1]))
    batched_systems = [OURS, *arms, *ggufs]
    batched = _batched(args, paths, batched_systems, counts, vocab, new_tokens, repetitions,
                       loads)
    header = (f"model {name} ({folder}), CPU, {args.threads} threads, prefill chunk "
              f"{args.chunk_size}, {new_tokens} new tokens, {repetitions} rounds, OMP_WAIT_POLICY "
              f"{args.omp_wait_policy}; 1-minute load "
              f"average before each measurement: min {min(loads):.2f}, median "
              f"{sorted(loads)[len(loads) // 2]:.2f}, max {max(loads):.2f}")
    batched_header = (f"Batched: {', '.join(map(str, counts))} sequences of {args.batch_prompt} "
                      f"prompt tokens, {new_tokens} new each" if counts else "")
    table = "\n\n".join(filter(None, [
        f"**{left_out}**" if left_out else "", header,
        *([_table(systems, lengths, runs), *[_table(systems, lengths, runs, arm)
                                               for arm in arms]] if lengths else []),
        batched_header, _batched_table(batched_systems, counts, batched) if counts else ""]))
    results = {"model": name, "folder": str(folder), "threads": args.threads,
               "omp_wait_policy": args.omp_wait_policy,
               "chunk_size": args.chunk_size, "int4_block_size": args.int4_block_size,
               "int8_matmul": args.int8_matmul, "no_int8_matmul": args.no_int8_matmul,
               "new_tokens": new_tokens, "lengths": lengths,
               "repetitions": repetitions, "systems": systems, "left_out": left_out,
               "gguf": {system: str(path) for system, path in ggufs.items()},
               "load_averages": loads,
               "runs": {f"{length}/{system}": values for (length, system), values in runs.items()},
               "sequences": counts, "batch_prompt": args.batch_prompt,
               "batched": {f"{count}/{system}": values
                           for (count, system), values in batched.items()}}
    publish(args.out, f"vs_llamacpp_{name}{'_quick' if args.quick else ''}", results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
