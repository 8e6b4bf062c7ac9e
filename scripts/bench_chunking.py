"""Table 2: chunked against whole-prompt prefill in onnx-chunk: peak RSS and TTFT per length.

`chunked` is the provider's default configuration at chunk width 512 (on CPU: one
shape-generic session, padding off; the decode variant created at load); `whole` feeds the
prompt in one forward (chunk width = the KV capacity, padding off, as a runtime without
chunking does). Both generate one token, enough for TTFT
and the prefill's memory peak; each measurement is a fresh process, runs interleaved.

    .venv/bin/python scripts/bench_chunking.py [--variant int4]
"""

from __future__ import annotations

import sys

from _bench import environment as env
from _bench.child import measure_prompt, publish
from _bench.harness import (
    CHUNK_SIZE,
    PROMPT_LENGTHS,
    capped_lengths,
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
)

SYSTEMS = ("chunked", "whole")
NEW_TOKENS = 1


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    args = parser.parse_args(argv)
    repetitions = 2 if args.quick else args.repetitions
    lengths = ([int(value) for value in args.lengths.split(",")] if args.lengths
               else [300, 900] if args.quick else list(PROMPT_LENGTHS))
    model = env.source_model(args, "bench")
    config = env.model_config(model)
    capacity = config["context_length"]
    lengths = capped_lengths(lengths, capacity, NEW_TOKENS)

    runs: dict[tuple[int, str], list[dict]] = {}
    for round_index in range(repetitions):
        for length in lengths:
            prompt = seeded_prompt(length, config["vocab_size"])
            for system in round_order(SYSTEMS, round_index):
                chunked = system == "chunked"
                result = measure_prompt(env.worker_argv(sys.executable, "chunk_worker", {
                    "model": str(model), "prompts": [prompt], "new_tokens": NEW_TOKENS,
                    "chunk_size": CHUNK_SIZE if chunked else capacity,
                    "padding": None if chunked else False, "eos": config["eos_token_ids"]}),
                    f"round {round_index + 1}/{repetitions} {length:>5} tokens {system:<8}")
                runs.setdefault((length, system), []).append(result)

    rows = []
    for length in lengths:
        chunked_runs, whole_runs = runs[(length, "chunked")], runs[(length, "whole")]
        row: list[object] = [length]
        for field, digits in (("peak_rss_mb", 0), ("ttft_s", 3)):
            a = summarize(run[field] for run in chunked_runs)
            b = summarize(run[field] for run in whole_runs)
            row += [format_value(a, digits), format_value(b, digits), f"{ratio(a, b):.2f}x"]
        row.append(" ".join(f"{rows_}/{width}" for rows_, width in chunked_runs[0]["chunks"]))
        rows.append(row)
    table = markdown_table(
        ["prompt", "peak RSS MB chunked", "peak RSS MB whole", "RSS ratio", "TTFT s chunked",
         "TTFT s whole", "TTFT ratio", "chunks (rows/width)"], rows)
    name = f"chunking_{args.variant}{'_quick' if args.quick else ''}"
    results = {
        "variant": args.variant, "repetitions": repetitions, "chunk_size": CHUNK_SIZE,
        "lengths": lengths,
        "runs": {f"{length}/{system}": values for (length, system), values in runs.items()}}
    publish(args.out, name, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
