"""Table 1: onnx-chunk against onnxruntime-genai at the same chunk width, side by side.

Both systems load the same converted model (the bench decoder after `onnx-chunk convert`,
for genai with `--native-chunks off`, since genai 0.18's ONNX Runtime lacks that input; a genai
folder: what a deployment serves, and what onnx-chunk loads without the graph libraries)
and get the same seeded prompts, chunk width 512 (genai's `search.chunk_size`), greedy
search, stop at EOS, and each measurement runs in a fresh process of its own (peak RSS is that
process's). Runs are interleaved round by round. Reported as ratios onnx-chunk / genai of the
medians: TTFT (target <= 1.0), decode tokens/s (>= 1.0), peak RSS (<= 1.0), and whether every
run of both systems produced the same greedy tokens.

    .venv/bin/python scripts/bench_vs_genai.py [--variant int4] [--genai-venv PATH]

`--model NAME` measures a real-size benchmark model (scripts/make_bench_models.py, e.g.
qwen05-int4) or a builder-export folder instead of the bench decoder: converted once with
`onnx-chunk convert --chunk-size 512`, both systems stop at the model's own EOS ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _bench import environment as env
from _bench.child import measure_prompt, publish
from _bench.harness import (
    CHUNK_SIZE,
    NEW_TOKENS,
    PROMPT_LENGTHS,
    capped_lengths,
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)

SYSTEMS = ("onnx-chunk", "genai")


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai",
                        help="venv holding onnxruntime-genai (created when missing)")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    args = parser.parse_args(argv)
    repetitions, new_tokens = (2, 8) if args.quick else (args.repetitions, NEW_TOKENS)
    lengths = ([int(value) for value in args.lengths.split(",")] if args.lengths
               else [40, 300] if args.quick else list(PROMPT_LENGTHS))
    genai = env.genai_python(args.genai_venv)
    model = env.served_model(args, "bench", CHUNK_SIZE)
    # genai 0.18 brings an ONNX Runtime without GroupQueryAttention's query_seqlens: it loads
    # the same conversion without that wiring (the graph is otherwise the same).
    genai_model = env.served_model(args, "bench", CHUNK_SIZE, native_chunks="off")
    if args.model is None:
        label, eos = args.variant, env.EOS_TOKEN_ID
    else:
        label, eos = env.named_export(args.model)[0], env.model_config(model)["eos_token_ids"]
    config = env.model_config(model)
    lengths = capped_lengths(lengths, config["context_length"], new_tokens)

    runs: dict[tuple[int, str], list[dict]] = {}
    for round_index in range(repetitions):
        for length in lengths:
            prompt = seeded_prompt(length, config["vocab_size"])
            for system in round_order(SYSTEMS, round_index):
                if system == "genai":
                    argv_ = env.worker_argv(genai, "genai_worker", {
                        "model": str(genai_model.parent), "prompts": [prompt],
                        "new_tokens": new_tokens, "chunk_size": CHUNK_SIZE})
                else:
                    # KV capacity = genai's max_length for the request (prompt + new tokens):
                    # both systems size their cache for the same request.
                    argv_ = env.worker_argv(sys.executable, "chunk_worker", {
                        "model": str(model), "prompts": [prompt], "new_tokens": new_tokens,
                        "chunk_size": CHUNK_SIZE, "eos": eos,
                        "capacity": len(prompt) + new_tokens})
                result = measure_prompt(
                    argv_, f"round {round_index + 1}/{repetitions} {length:>5} tokens "
                           f"{system:<10}")
                runs.setdefault((length, system), []).append(result)

    rows = []
    for length in lengths:
        ours, theirs = runs[(length, "onnx-chunk")], runs[(length, "genai")]
        row: list[object] = [length]
        for field, digits, higher in (("ttft_s", 3, False), ("decode_tokens_per_s", 2, True),
                                      ("peak_rss_mb", 0, False)):
            a = summarize(run[field] for run in ours)
            b = summarize(run[field] for run in theirs)
            value = ratio(a, b)
            row += [format_value(a, digits), format_value(b, digits),
                    f"{value:.2f}x {verdict(value, 1.0, higher)}"]
        reference = theirs[0]["tokens"]
        row.append("yes" if all(run["tokens"] == reference for run in ours + theirs) else "NO")
        rows.append(row)
    table = markdown_table(
        ["prompt", "TTFT s onnx-chunk", "TTFT s genai", "TTFT ratio",
         "decode tok/s onnx-chunk", "decode tok/s genai", "decode ratio",
         "peak RSS MB onnx-chunk", "peak RSS MB genai", "RSS ratio", "tokens identical"], rows)
    name = f"vs_genai_{label}{'_quick' if args.quick else ''}"
    results = {
        "variant": args.variant, "model": args.model, "repetitions": repetitions,
        "new_tokens": new_tokens,
        "chunk_size": CHUNK_SIZE, "lengths": lengths,
        "runs": {f"{length}/{system}": values for (length, system), values in runs.items()}}
    publish(args.out, name, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
