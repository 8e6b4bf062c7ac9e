"""Does prefix reuse change answers? Multi-turn conversations with reuse on and off, compared.

Two runtimes on the same model, loaded as `onnx-chunk serve` loads them (the batch engine,
`--batch` slots): one with prefix reuse (the default), one with `prefix_reuse=False` (`serve
--no-prefix-reuse`). A conversation is a shared system prefix (`--system-tokens` ids, the same in
every conversation, so a first turn reuses the previous conversation's) and `--turns` user turns
of `--user-tokens` random ids; each turn's prompt is the previous turn's prompt, its answer
(`--max-tokens` new tokens) and the next user turn, as a chat client resends it. The answers
without reuse make the prompts, so every turn of both runtimes answers the same prompt.

Each conversation runs once greedy and once seeded (temperature 0.9, top_p 0.9, top_k 40, the
seed `--seed` + the conversation's number). A third arm sends each prompt to the reusing runtime
with a namespace of its own, which is what `cache_prompt: false` does in the server (a fresh
prefill): its answers should equal the no-reuse runtime's bit for bit.

Printed per sampling mode: the answers that differ (reuse against no reuse) out of those
compared, per turn, the conversations with any differing answer, the first differing token's
index (min / median / max), the largest |logprob difference| over the tokens before it (where
the tokens agree), the mean cached tokens per turn, and the fresh arm's differing answers and
largest logprob difference; then the load average before and after.

    .venv/bin/python scripts/bench_reuse.py [MODEL] [--conversations 200] [--turns 3]
        [--max-tokens 16] [--exact] [--time-limit SECONDS] [--json out.json] [--first N]
        [--merge earlier.json ...]
    .venv/bin/python scripts/bench_reuse.py [MODEL] --resend 40,129,512 [--conversations 3]

`--resend LENGTHS` asks the question of a prompt sent again: per length, `--conversations`
random prompts, each answered greedily by the no-reuse runtime, then sent three times to the
reusing one (its first send a fresh prefill, then two resends that reuse all of it but the ids
a reuse leaves to feed); printed per length: the resends whose answer differs from the
no-reuse answer, and their cached tokens.

MODEL is a model folder or a bench model's name (default qwen05-int4; scripts/_bench/models.py,
built by scripts/make_bench_models.py). `--time-limit` stops starting conversations after that
many seconds; the report says how many ran. A run that stopped there is continued by another
from `--first` (the next conversation's number) with `--merge` naming the first run's --json:
the report counts both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _bench.harness import FIRST_PROMPT_ID, markdown_table
from _bench.models import BenchModelMissing, model_folder

from onnx_chunk import load
from onnx_chunk.sampling import Sampling

DEFAULT_MODEL = "qwen05-int4"
ARMS = ("no reuse", "reuse", "fresh")
MODES = ("greedy", "seeded")


def sampling(mode: str, seed: int, salt: str | None) -> Sampling:
    """Greedy, or the seeded draw the issue names; the chosen token's logprob either way."""
    if mode == "greedy":
        return Sampling(logprobs=0, cache_salt=salt)
    return Sampling(temperature=0.9, top_p=0.9, top_k=40, seed=seed, logprobs=0,
                    cache_salt=salt)


def answer(runtime, prompt: list[int], max_tokens: int, chosen: Sampling) -> dict:
    """One request through the engine: its tokens, their logprobs and its cached tokens."""
    request = runtime.submit(prompt, max_tokens, sampling=chosen, wait=True)
    tokens = request.result()
    return {"tokens": [int(token) for token in tokens],
            "logprobs": [float(entry.logprob) for entry in request.logprobs],
            "cached": int(request.stats.cached_tokens)}


def compare(reference: dict, other: dict) -> tuple[int | None, float]:
    """The first index where the tokens differ (None: equal) and the largest |logprob
    difference| over the tokens before it."""
    first = next((index for index, (a, b) in enumerate(zip(reference["tokens"],
                                                          other["tokens"])) if a != b), None)
    if first is None and len(reference["tokens"]) != len(other["tokens"]):
        first = min(len(reference["tokens"]), len(other["tokens"]))
    agree = len(reference["tokens"]) if first is None else first
    gaps = [abs(a - b) for a, b in zip(reference["logprobs"][:agree], other["logprobs"][:agree])]
    return first, max(gaps, default=0.0)


def conversation(runtimes: dict, system: list[int], number: int, mode: str,
                 args: argparse.Namespace, vocab: int) -> list[dict]:
    """One conversation's turns: per arm the answer, and its comparison with no reuse."""
    rng = np.random.default_rng([args.seed, 1, number])
    prompt = list(system)
    turns = []
    for turn in range(args.turns):
        prompt += [int(t) for t in rng.integers(FIRST_PROMPT_ID, vocab, size=args.user_tokens)]
        seed = args.seed + number
        answers = {
            "no reuse": answer(runtimes["no reuse"], prompt, args.max_tokens,
                               sampling(mode, seed, None)),
            "reuse": answer(runtimes["reuse"], prompt, args.max_tokens,
                            sampling(mode, seed, None)),
            "fresh": answer(runtimes["reuse"], prompt, args.max_tokens,
                            sampling(mode, seed, f"fresh:{mode}:{number}:{turn}"))}
        record = {"number": number, "turn": turn + 1, "prompt_tokens": len(prompt),
                  **answers}
        for arm in ("reuse", "fresh"):
            first, gap = compare(answers["no reuse"], answers[arm])
            record[f"{arm}_first_difference"] = first
            record[f"{arm}_max_logprob_gap"] = gap
        turns.append(record)
        prompt += answers["no reuse"]["tokens"]
    return turns


def report(runs: dict[str, list[list[dict]]], args: argparse.Namespace,
           loads: tuple[tuple[float, ...], tuple[float, ...]], elapsed: float) -> str:
    load = " / ".join(" ".join(f"{value:.2f}" for value in values) for values in loads)
    done = len(runs["greedy"])
    lines = [f"{args.model.name}: {done} conversations (of {args.conversations} asked) of "
             f"{args.turns} turns, {args.system_tokens} shared system ids, {args.user_tokens} "
             f"user ids and {args.max_tokens} answer tokens per turn, batch {args.batch}, "
             f"{args.threads or 'default'} threads, {elapsed:.0f} s; load average before / after: "
             f"{load}", ""]
    rows = []
    for mode in MODES:
        turns = [turn for conv in runs[mode] for turn in conv]
        firsts = [turn["reuse_first_difference"] for turn in turns
                  if turn["reuse_first_difference"] is not None]
        per_turn = []
        for number in range(1, args.turns + 1):
            these = [turn for turn in turns if turn["turn"] == number]
            differing = sum(turn["reuse_first_difference"] is not None for turn in these)
            cached = statistics.mean(turn["reuse"]["cached"] for turn in these) if these else 0
            per_turn.append(f"{differing}/{len(these)} (cached {cached:.0f})")
        conversations = sum(any(turn["reuse_first_difference"] is not None for turn in conv)
                            for conv in runs[mode])
        spread = (f"{min(firsts)} / {statistics.median(firsts):g} / {max(firsts)}"
                  if firsts else "-")
        fresh = sum(turn["fresh_first_difference"] is not None for turn in turns)
        rows.append([mode, f"{len(firsts)}/{len(turns)}", f"{conversations}/{len(runs[mode])}",
                     "; ".join(per_turn), spread,
                     f"{max((t['reuse_max_logprob_gap'] for t in turns), default=0.0):.3g}",
                     f"{fresh}/{len(turns)}",
                     f"{max((t['fresh_max_logprob_gap'] for t in turns), default=0.0):.3g}"])
    lines.append(markdown_table(
        ["mode", "answers differing", "conversations differing",
         "per turn: differing (mean cached tokens)", "first differing token min / median / max",
         "max |logprob gap| where tokens agree", "fresh arm differing",
         "fresh arm max |logprob gap|"], rows))
    return "\n".join(lines)


# The settings that must agree for runs to be counted together (--merge).
_SAME = ("model", "turns", "system_tokens", "user_tokens", "max_tokens", "batch", "seed",
         "exact")


def _earlier(path: Path, args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The runs of an earlier --json, refused when its settings differ from this run's."""
    try:
        data = json.loads(path.read_text())
        settings, runs = data["args"], data["runs"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--merge {path}: not a bench_reuse.py --json file ({error})")
    differ = [name for name in _SAME if settings.get(name) != str(getattr(args, name))]
    if differ:
        parser.error(f"--merge {path}: its {', '.join(differ)} differ from this run's")
    # A run made before --first existed numbers its conversations from 0, in order.
    first = int(settings.get("first", 0))
    for mode in MODES:
        for index, conv in enumerate(runs[mode]):
            for record in conv:
                record.setdefault("number", first + index)
    return runs


def _numbers(runs: dict) -> list[int]:
    return [conv[0]["number"] for conv in runs["greedy"]]


def resend(runtimes: dict, lengths: list[int], args: argparse.Namespace,
           vocab: int) -> str:
    """`--resend`: per prompt length, how many greedy resends answer otherwise than no reuse."""
    rows = []
    for length in lengths:
        rng = np.random.default_rng([args.seed, 2, length])
        differ, cached = 0, set[int]()
        for _ in range(args.conversations):
            prompt = [int(t) for t in rng.integers(FIRST_PROMPT_ID, vocab, size=length)]
            expected = answer(runtimes["no reuse"], prompt, args.max_tokens,
                              sampling("greedy", 0, None))["tokens"]
            sends = [answer(runtimes["reuse"], prompt, args.max_tokens,
                            sampling("greedy", 0, None)) for _ in range(3)]
            differ += sum(send["tokens"] != expected for send in sends[1:])
            cached.update(send["cached"] for send in sends[1:])
        rows.append([length, f"{differ} of {2 * args.conversations}",
                     ", ".join(map(str, sorted(cached)))])
    return markdown_table(["prompt tokens", "resends differing from no reuse",
                           "cached tokens"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="a model folder, or a bench model's name (default qwen05-int4)")
    parser.add_argument("--conversations", type=int, default=200)
    # Conversation settings (None: their defaults), refused with --resend.
    parser.add_argument("--turns", type=int, default=None, help="default 3")
    parser.add_argument("--system-tokens", type=int, default=None, help="default 32")
    parser.add_argument("--user-tokens", type=int, default=None, help="default 24")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="slots (serve's default 4)")
    parser.add_argument("--provider", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of each runtime (default ONNX Runtime's)")
    parser.add_argument("--exact", action="store_true",
                        help="both runtimes in exact mode (`serve --exact`)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="start no conversation after this many seconds")
    parser.add_argument("--json", type=Path, default=None, help="write every answer here")
    parser.add_argument("--first", type=int, default=None,
                        help="the number of the first conversation (a continuation of a run "
                             "that stopped at its --time-limit)")
    parser.add_argument("--resend", default=None, metavar="LENGTHS",
                        help="comma-separated prompt lengths: prompts sent again (see above) "
                             "instead of conversations")
    parser.add_argument("--merge", type=Path, action="append", default=[],
                        help="the --json of an earlier run of the same settings and other "
                             "conversations: the report counts its conversations too")
    args = parser.parse_args(argv)
    conversational: dict[str, object] = {"turns": 3, "system_tokens": 32, "user_tokens": 24,
                                         "first": 0, "time_limit": None, "json": None,
                                         "merge": []}
    given = [name for name in conversational if getattr(args, name) not in (None, [])]
    if args.resend is not None and given:
        parser.error(f"--resend sends prompts, not conversations: it takes no "
                     f"--{given[0].replace('_', '-')}")
    for name, default in conversational.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("conversations", "turns", "system_tokens", "user_tokens", "max_tokens",
                 "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.seed < 0 or args.first < 0:
        parser.error("--seed and --first must be at least 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    lengths = []
    if args.resend is not None:
        try:
            lengths = [int(part) for part in args.resend.split(",")]
        except ValueError:
            parser.error(f"--resend takes comma-separated prompt lengths, got {args.resend!r}")
        if not lengths or min(lengths) < 1:
            parser.error("--resend: every prompt length must be at least 1")
    try:
        args.model = model_folder(args.model)
    except BenchModelMissing as error:
        parser.error(str(error))
    earlier = [_earlier(path, args, parser) for path in args.merge]
    seen = [number for runs_of in earlier for number in _numbers(runs_of)]
    planned = set(range(args.first, args.first + args.conversations))
    if len(set(seen)) != len(seen) or planned & set(seen):
        parser.error("--merge: the runs share conversation numbers (see --first)")
    load_before = os.getloadavg()
    started = time.monotonic()
    options = {"provider": args.provider, "max_batch": args.batch,
               "intra_op_threads": args.threads, "exact": args.exact}
    runtimes = {"no reuse": load(args.model, prefix_reuse=False, **options),
                "reuse": load(args.model, **options)}
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    try:
        vocab = runtimes["reuse"].stats.vocab_size
        needed = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
        if not lengths and needed > runtimes["reuse"].stats.capacity:
            parser.error(f"a conversation needs {needed} positions, the capacity is "
                         f"{runtimes['reuse'].stats.capacity}")
        if lengths:
            if max(lengths) + args.max_tokens > runtimes["reuse"].stats.capacity:
                parser.error(f"--resend: {max(lengths)} prompt tokens and {args.max_tokens} "
                             f"new exceed the capacity {runtimes['reuse'].stats.capacity}")
            print(resend(runtimes, lengths, args, vocab))
            print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
            return 0
        system = [int(t) for t in np.random.default_rng([args.seed, 0]).integers(
            FIRST_PROMPT_ID, vocab, size=args.system_tokens)]
        for number in range(args.first, args.first + args.conversations):
            if args.time_limit is not None and time.monotonic() - started > args.time_limit:
                break
            for mode in MODES:
                runs[mode].append(conversation(runtimes, system, number, mode, args, vocab))
    finally:
        for runtime in runtimes.values():
            runtime.close()
    elapsed = time.monotonic() - started
    loads = (load_before, os.getloadavg())
    merged = {mode: [conv for runs_of in [*earlier, runs] for conv in runs_of[mode]]
              for mode in MODES}
    print(report(merged, args, loads, elapsed))
    if earlier:
        print(f"\n{len(runs['greedy'])} conversations from this run, "
              f"{len(merged['greedy']) - len(runs['greedy'])} from {len(earlier)} earlier")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {key: str(value) for key, value in
                                                  vars(args).items()},
                                         "load_average": loads, "elapsed_s": elapsed,
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
