"""logprobs' cost: decode tokens/s with `top_logprobs: 5` against without (goal >= 0.9x).

Both systems decode greedily on the same runtime, one request at a time, MAX_NEW new tokens
each (EOS ignored, so both run the full length): greedy choice without processors is the
cheapest choice (an argmax), so the logprobs' work (a log-softmax over the vocabulary and an
argpartition for the top 5, per token) weighs most against it. Tokens/s is the runtime's own
decode rate of each request (`RequestStats.decode_tokens_per_s`, counted from its token
events). Systems are interleaved, the first rotating each round; medians and spread; the load
average before and after.

The full run uses the `bench` reference decoder (vocabulary 32000); `--quick` is a smoke run
on a fixture export (vocabulary 384).

    .venv/bin/python scripts/bench_logprobs.py [--quick] [--repetitions 5]
"""

from __future__ import annotations

import os
import sys

import numpy as np
from _bench import environment as env
from _bench.child import publish
from _bench.harness import decode_ratio_result, decode_rounds

PLAIN, LOGPROBS = "no logprobs", "top_logprobs 5"
GOAL = 0.9
TOP = 5
FULL = {"requests": 4, "new_tokens": 128, "prompt_tokens": 64}
QUICK = {"requests": 2, "new_tokens": 16, "prompt_tokens": 8}
FIXTURE = env.ROOT / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0], variant=False)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    repetitions = 2 if args.quick else args.repetitions
    if args.model is not None:
        model = env.named_export(args.model)[1]
    else:
        model = FIXTURE if args.quick else env.build_model(args.out, "bench")
    from onnx_chunk.runtime import load
    from onnx_chunk.sampling import Sampling

    load_before = os.getloadavg()
    with load(model, provider="cpu") as runtime:
        vocab = runtime.stats.vocab_size
        prompts = [np.random.default_rng(seed).integers(3, vocab, plan["prompt_tokens"])
                   for seed in range(plan["requests"])]

        def run_round(system: str, _: int) -> tuple[list[float], int]:
            sampling = Sampling(logprobs=TOP if system == LOGPROBS else None)
            rates, tokens = [], 0
            for prompt in prompts:
                request = runtime.submit(prompt, plan["new_tokens"], eos_token_id=[],
                                         sampling=sampling)
                tokens += len(request.result())
                if system == LOGPROBS and len(request.logprobs) != plan["new_tokens"]:
                    raise SystemExit("a request with logprobs gave fewer entries than tokens")
                rate = request.stats.decode_tokens_per_s
                assert rate is not None  # more than one token, EOS off
                rates.append(rate)
            return rates, tokens

        runs = decode_rounds((PLAIN, LOGPROBS), repetitions, run_round)
    data, table = decode_ratio_result(
        runs, PLAIN, LOGPROBS, GOAL,
        f"model {model.parent.name if model.is_file() else model.name}, vocabulary {vocab}, "
        f"{plan['requests']} requests x {plan['new_tokens']} new tokens per round (greedy)",
        plan, repetitions, load_before)
    publish(args.out, "logprobs" + ("_quick" if args.quick else ""), data, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
