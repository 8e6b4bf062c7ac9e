"""Prompts arriving together: native batched prefill against one slot per forward.

`--prompts` seeded prompts of `--shortest` to `--longest` tokens (evenly spread) are submitted at
once to a runtime with as many slots (the batch engine), on a converted builder export whose
GroupQueryAttention takes `query_seqlens` (native chunks). Three arms, each a fresh process per
round, interleaved in rotating order:
- `rule`: the engine as it is: a round's prefill chunks of several slots run in one forward
  [slots, S] only where that computes no more rows than one forward per chunk (the scheduler's
  `batch_pays`);
- `batched`: every round of two or more chunks in one forward [slots, S] (`batch_pays`
  replaced in the child through `onnx_chunk.runtime.debug.prefill_batching`: at least two
  chunks);
- `one per forward`: `batch_pays` answering no: every prefill chunk is a forward of its slot.
Measured from the submit: the time until every request has its first token (the goal's
number), the median request's, the last request's whole generation, and the forwards the
runner ran (its `run`, counted in the child through `runtime.debug.runner`): prefill forwards
of one slot and of several, decode forwards. Tokens of the two arms are compared per request
(INT4 kernels round by the rows of a forward, so they may differ there).

    .venv/bin/python scripts/bench_batched_prefill.py [--model qwen05-int4] [--prompts 8]
        [--shortest 100] [--longest 2000] [--new-tokens 8] [--repetitions 3] [--out bench-out]
"""

from __future__ import annotations

import argparse
import os
import statistics
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

RULE, BATCHED, ALONE = "rule", "batched", "one per forward"
ARMS = (RULE, BATCHED, ALONE)

_CHILD = r"""
import contextlib, json, sys
request = json.loads(sys.argv[1])
import onnx_chunk
from onnx_chunk.runtime import debug

RULES = {"one per forward": lambda widths, slots: False,
         "batched": lambda widths, slots: len(widths) >= 2}
forwards = {"prefill one slot": 0, "prefill several slots": 0, "decode": 0}


def counting(run):
    def counted(slot, forward):
        fed = [len(row.tokens) for row in forward.rows if row.steps]
        if max(fed, default=0) > 1:
            forwards["prefill several slots" if len(fed) > 1 else "prefill one slot"] += 1
        else:
            forwards["decode"] += 1
        return run(slot, forward)
    return counted


def measure(prompts, new_tokens):
    runtime = onnx_chunk.load(request["model"], provider="cpu", max_batch=len(prompts),
                              capacity=max(map(len, prompts)) + new_tokens)
    # Every forward the engine runs goes through its runner's `run`.
    runner = runtime.debug.runner
    runner.run = counting(runner.run)
    runtime.generate_many([[5, 6, 7, 8]], 2, eos_token_id=[])  # the session's first run
    for key in forwards:
        forwards[key] = 0
    requests = [runtime.submit(prompt, new_tokens, eos_token_id=[]) for prompt in prompts]
    tokens = [[int(token) for token in handle.result()] for handle in requests]
    # token_times count from each submit; the submits took microseconds, so from the first.
    submitted = [handle.token_times for handle in requests]
    runtime.close()
    return {"first_token_s": [times[0] for times in submitted],
            "done_s": [times[-1] for times in submitted], "tokens": tokens,
            "forwards": forwards}


with contextlib.ExitStack() as arm:
    if request["arm"] in RULES:
        arm.enter_context(debug.prefill_batching(RULES[request["arm"]]))
    result = measure(request["prompts"], request["new_tokens"])
print(json.dumps(result))
"""


def measure_one(arm: str, model: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    import json

    child = run_child([sys.executable, "-c", _CHILD, json.dumps({
        "arm": arm, "model": str(model), "prompts": prompts, "new_tokens": new_tokens})],
        timeout_s=1800)
    result = dict(child.payload)
    result.update(all_first_s=max(result["first_token_s"]),
                  median_first_s=statistics.median(result["first_token_s"]),
                  all_done_s=max(result["done_s"]), peak_rss_mb=child.peak_rss_mb,
                  load_average=os.getloadavg()[0])
    return result


def table(runs: dict[str, list[dict]], header: str) -> str:
    fields = (("all_first_s", 3), ("median_first_s", 3), ("all_done_s", 3), ("peak_rss_mb", 0))
    rows = []
    for arm, arm_runs in runs.items():
        forwards = arm_runs[0]["forwards"]
        rows.append([arm, *(format_value(summarize(run[field] for run in arm_runs), digits)
                            for field, digits in fields),
                     f"{forwards['prefill one slot']} / {forwards['prefill several slots']} / "
                     f"{forwards['decode']}"])
    for arm in (RULE, BATCHED):
        rows.append([f"{arm} / {ALONE}", *(
            f"{ratio(summarize(r[field] for r in runs[arm]), summarize(r[field] for r in runs[ALONE])):.2f}x"  # noqa: E501
            for field, _ in fields), ""])
    alone = runs[ALONE][0]["tokens"]
    same = "; ".join(f"{arm} {sum(a == b for a, b in zip(runs[arm][0]['tokens'], alone))} of "
                     f"{len(alone)}" for arm in (RULE, BATCHED))
    return (markdown_table([header, "every request's first token s", "median first token s",
                            "every request done s", "peak RSS MB",
                            "forwards: prefill one slot / several slots / decode"], rows)
            + f"\n\nrequests with the tokens of `{ALONE}`: {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen05-int4",
                        help="a bench model's name or a builder-export folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=100)
    parser.add_argument("--longest", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--out", type=Path, default=env.ROOT / "bench-out")
    args = parser.parse_args(argv)
    for name in ("prompts", "shortest", "longest", "new_tokens", "repetitions", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.shortest > args.longest:
        parser.error("--shortest must not exceed --longest")
    try:
        name, folder = env.export_folder(args.model)
    except BenchModelMissing as error:
        parser.error(str(error))
    model = env.converted_export(args.out, name, folder, args.chunk_size)
    vocab = env.model_config(model)["vocab_size"]
    step = (args.longest - args.shortest) / max(args.prompts - 1, 1)
    prompts = [seeded_prompt(round(args.shortest + index * step), vocab, seed=index)
               for index in range(args.prompts)]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for round_index in range(args.repetitions):
            for arm in round_order(ARMS, round_index):
                run = measure_one(arm, model, prompts, args.new_tokens)
                runs[arm].append(run)
                print(f"round {round_index + 1}/{args.repetitions} {arm:<16} every first token "
                      f"{run['all_first_s']:.3f} s, forwards {run['forwards']}, load average "
                      f"{run['load_average']:.2f}", file=sys.stderr)
    except ChildFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    loads = [run["load_average"] for arm_runs in runs.values() for run in arm_runs]
    header = (f"{name}, CPU, {args.prompts} prompts of {args.shortest}-{args.longest} tokens "
              f"at once, {args.new_tokens} new, W {args.chunk_size}, {args.repetitions} rounds, "
              f"load average {min(loads):.2f}-{max(loads):.2f}")
    publish(args.out, f"batched_prefill_{name}", {"args": {k: str(v) for k, v in
                                                           vars(args).items()},
                                                  "prompts": [len(p) for p in prompts],
                                                  "runs": runs}, table(runs, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
