"""What exact mode costs: time to first token, decode and an 8-slot batch, against the default.

Each measurement is a process of its own (`_bench.child`: its own peak RSS), the default and
exact arms interleaved round by round; medians with their spread and the load average.

A worker loads the model as `onnx-chunk serve` does (the batch engine, `--batch` slots; exact
mode or not) and runs, after a one-prompt warm-up: one request at each `--lengths` prompt
length (TTFT: submit to first token; decode: tokens/s after it; `--new-tokens` new tokens), then
`--batch` requests of `--batch-lengths` tokens submitted at once (tokens/s over their wall time).
The exact arm also checks its promise on those requests: each one's tokens and logprobs alone
(one at a time) equal its batched ones bit for bit.

    .venv/bin/python scripts/bench_exact.py [--model qwen05-int4] [--rounds 3]
        [--lengths 513,1001] [--new-tokens 32] [--batch 8] [--batch-lengths 100,300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _bench.child import run_child
from _bench.harness import markdown_table, seeded_prompt
from _bench.models import BenchModelMissing, model_folder

ARMS = ("default", "exact")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen05-int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", default="513,1001")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batch-lengths", default="100,300",
                        help="the batch's prompts spread evenly over this range")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--worker", choices=ARMS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(part) for part in args.lengths.split(",")]
        low, high = (int(part) for part in args.batch_lengths.split(","))
    except ValueError:
        parser.error("--lengths and --batch-lengths take integers separated by commas")
    if min(args.lengths) < 1 or args.rounds < 1 or args.batch < 1 or args.new_tokens < 1:
        parser.error("--lengths, --rounds, --batch and --new-tokens must be at least 1")
    args.batch_lengths = [low + (high - low) * index // max(args.batch - 1, 1)
                          for index in range(args.batch)]
    try:
        args.folder = model_folder(args.model)
    except BenchModelMissing as error:
        parser.error(str(error))
    return args


def _answer(request) -> tuple[list[int], list[float]]:
    tokens = request.result(timeout=3600)
    return tokens, [step.logprob for step in request.logprobs]


def worker(args: argparse.Namespace) -> dict:
    from onnx_chunk import Sampling, load

    exact = args.worker == "exact"
    greedy = Sampling(logprobs=0)
    result: dict = {"ttft_s": {}, "decode_tps": {}}
    with load(args.folder, provider="cpu", max_batch=args.batch, prefix_reuse=False,
              intra_op_threads=args.threads, exact=exact) as runtime:
        vocab = runtime.stats.vocab_size
        runtime.submit(seeded_prompt(40, vocab, 99), 4, eos_token_id=[]).result()
        for length in args.lengths:
            request = runtime.submit(seeded_prompt(length, vocab, length), args.new_tokens,
                                     eos_token_id=[], sampling=greedy)
            request.result(timeout=3600)
            result["ttft_s"][str(length)] = request.stats.ttft_s
            result["decode_tps"][str(length)] = request.stats.decode_tokens_per_s
        prompts = [seeded_prompt(length, vocab, 1000 + index)
                   for index, length in enumerate(args.batch_lengths)]
        started = time.perf_counter()
        batched = [runtime.submit(prompt, args.new_tokens, eos_token_id=[], sampling=greedy)
                   for prompt in prompts]
        answers = [_answer(request) for request in batched]
        seconds = time.perf_counter() - started
        result["batch_tps"] = args.batch * args.new_tokens / seconds
        if exact:
            alone = [_answer(runtime.submit(prompt, args.new_tokens, eos_token_id=[],
                                            sampling=greedy)) for prompt in prompts]
            result["batched_equals_alone"] = sum(a == b for a, b in zip(alone, answers))
    return result


def _cell(values: list[float], digits: int = 2) -> str:
    median = statistics.median(values)
    spread = (max(values) - min(values)) / 2 / median * 100 if median else 0.0
    return f"{median:.{digits}f} ±{spread:.0f}%"


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return 0
    passed = [arg for arg in (argv if argv is not None else sys.argv[1:])]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        for arm in ARMS if round_index % 2 == 0 else ARMS[::-1]:
            child = run_child([sys.executable, __file__, *passed, "--worker", arm],
                              timeout_s=args.timeout)
            runs[arm].append({**child.payload, "peak_rss_mb": child.peak_rss_mb})
            loads.append(os.getloadavg()[0])
    rows = []
    for length in map(str, args.lengths):
        for figure, label in (("ttft_s", f"TTFT at {length} tokens (s)"),
                              ("decode_tps", f"decode at {length} tokens (tok/s)")):
            values = {arm: [run[figure][length] for run in runs[arm]] for arm in ARMS}
            ratios = [exact / default for default, exact in zip(values["default"],
                                                                 values["exact"])]
            digits = 3 if figure == "ttft_s" else 1
            rows.append([label, _cell(values["default"], digits), _cell(values["exact"], digits),
                         f"{statistics.median(ratios):.3f}x"])
    for figure, label in (("batch_tps", f"{args.batch} slots, {args.batch_lengths[0]}-"
                                        f"{args.batch_lengths[-1]} tokens (tok/s)"),
                          ("peak_rss_mb", "peak RSS (MB)")):
        values = {arm: [run[figure] for run in runs[arm]] for arm in ARMS}
        ratios = [exact / default for default, exact in zip(values["default"], values["exact"])]
        rows.append([label, _cell(values["default"], 1), _cell(values["exact"], 1),
                     f"{statistics.median(ratios):.3f}x"])
    print(f"{args.model}, {args.rounds} rounds, {args.new_tokens} new tokens; load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(markdown_table(["", "default", "exact", "exact / default"], rows))
    equal = [run["batched_equals_alone"] for run in runs["exact"]]
    print(f"exact: batched equals alone (tokens and logprobs) for {min(equal)}-{max(equal)} of "
          f"{args.batch} requests per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
