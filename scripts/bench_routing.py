"""Cached tokens per turn across Ray Serve replicas: prefix affinity against power of two.

Starts a local Ray (127.0.0.1 only) and serves MODEL as `--replicas` replicas
(`onnx_chunk.serve.ray.application`), once routed by prefix affinity (`routing="prefix"`) and
once by Ray's default power of two choices (`routing="power-of-two"`), the same workload each
time: `--chats` conversations at once, each `--turns` turns in a row through the openai
client (greedy, `--max-tokens` new tokens; each user message a seeded text of
`--user-words` words), every turn resending the whole conversation as chat clients do. Per
turn and routing it reports the mean prompt tokens, the mean cached tokens
(`usage.prompt_tokens_details.cached_tokens`: the prompt tokens the replica's engine reused
from its slots; "not reported" where the server does not count them) and the share of the
chats whose turn landed on the replica of their previous turn (`x-onnx-chunk-replica`).
Latencies are left out: on a shared machine they measure the neighbours.

    .venv/bin/python scripts/bench_routing.py [MODEL] [--replicas 2] [--chats 8] [--turns 8]
        [--max-tokens 32] [--user-words 40] [--batch 4] [--routings prefix,power-of-two]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"
ROUTINGS = ("prefix", "power-of-two")
_WORDS = ("the keeper lights a lamp above the harbour while ships pass through fog and "
          "rain, and every night he writes down what the sea brought in").split()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _user_text(chat: int, turn: int, words: int) -> str:
    rng = random.Random(chat * 1000 + turn)
    return f"Chat {chat}, turn {turn}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def _chat(client, model_name: str, chat: int, options: argparse.Namespace) -> list[dict]:
    """One conversation of `turns` turns; per turn its usage and the replica that served it."""
    from onnx_chunk.serve.ray import REPLICA_HEADER

    messages: list[dict] = []
    turns = []
    for turn in range(options.turns):
        messages.append({"role": "user", "content": _user_text(chat, turn, options.user_words)})
        raw = client.chat.completions.with_raw_response.create(
            model=model_name, messages=messages, max_tokens=options.max_tokens, temperature=0)
        answer = raw.parse()
        details = answer.usage.prompt_tokens_details
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        turns.append({"prompt_tokens": answer.usage.prompt_tokens, "cached_tokens": cached,
                      "replica": raw.headers[REPLICA_HEADER]})
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    return turns


def run_routing(routing: str, options: argparse.Namespace) -> list[list[dict]]:
    """Every chat's turns under one routing (a fresh Serve app on the running Ray)."""
    import openai
    from ray import serve

    from onnx_chunk.serve.ray import application

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(application(options.model, replicas=options.replicas, provider="cpu",
                              cpus_per_replica=options.cpus_per_replica, batch=options.batch,
                              intra_op_threads=1, routing=routing), route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        model_name = client.models.list().data[0].id
        with ThreadPoolExecutor(options.chats) as pool:
            return list(pool.map(lambda chat: _chat(client, model_name, chat, options),
                                 range(options.chats)))
    finally:
        serve.shutdown()


def table(results: dict[str, list[list[dict]]], turns: int) -> str:
    """Per turn: mean prompt tokens, mean cached tokens, share on the previous replica."""
    header = ["turn"]
    for routing in results:
        header += [f"{routing}: prompt", f"{routing}: cached", f"{routing}: same replica"]
    lines = ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    for turn in range(turns):
        row = [str(turn + 1)]
        for chats in results.values():
            prompt = statistics.fmean(chat[turn]["prompt_tokens"] for chat in chats)
            cached = [chat[turn]["cached_tokens"] for chat in chats]
            same = ([chat[turn]["replica"] == chat[turn - 1]["replica"] for chat in chats]
                    if turn else [])
            row += [f"{prompt:.0f}",
                    "not reported" if None in cached else f"{statistics.fmean(cached):.0f}",
                    f"{sum(same)}/{len(same)}" if turn else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def totals(results: dict[str, list[list[dict]]]) -> str:
    """Turns per replica, and cached over prompt tokens of every turn, per routing."""
    lines = []
    for routing, chats in results.items():
        turns = [turn for chat in chats for turn in chat]
        served = sorted(Counter(turn["replica"] for turn in turns).values(), reverse=True)
        lines.append(f"{routing}: turns per replica {served}")
        prompt = sum(turn["prompt_tokens"] for turn in turns)
        if any(turn["cached_tokens"] is None for turn in turns):
            lines.append(f"{routing}: {prompt} prompt tokens, cached tokens not reported by "
                         "this server (usage.prompt_tokens_details.cached_tokens)")
        else:
            cached = sum(turn["cached_tokens"] for turn in turns)
            lines.append(f"{routing}: {cached} of {prompt} prompt tokens cached "
                         f"({cached / prompt:.1%})")
    return "\n".join(lines)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=FIXTURE)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--cpus-per-replica", type=float, default=0.5)
    parser.add_argument("--routings", default=",".join(ROUTINGS))
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = _arguments(argv)
    routings = options.routings.split(",")
    if not set(routings) <= set(ROUTINGS) or min(options.replicas, options.chats,
                                                 options.turns, options.max_tokens) < 1:
        print(f"error: --routings takes some of {', '.join(ROUTINGS)} and the counts must be "
              f">= 1; got {options.routings!r}", file=sys.stderr)
        return 2
    if not options.model.exists():
        print(f"error: no model at {options.model}", file=sys.stderr)
        return 2
    import ray

    ray.init(num_cpus=max(2, options.replicas), include_dashboard=False, log_to_driver=False)
    try:
        results = {routing: run_routing(routing, options) for routing in routings}
    finally:
        ray.shutdown()
    print(f"{options.model.name}: {options.replicas} replicas (batch {options.batch}), "
          f"{options.chats} chats x {options.turns} turns, {options.max_tokens} new tokens, "
          f"user messages of {options.user_words} words\n")
    print(table(results, options.turns))
    print()
    print(totals(results))
    if options.json is not None:
        options.json.write_text(json.dumps({"options": {k: str(v) for k, v in
                                                        vars(options).items()},
                                            "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
