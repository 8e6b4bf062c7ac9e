"""An 8-turn chat over HTTP: the last turn's time to first token with prefix reuse and without.

Two `onnx-chunk serve` subprocesses on the same model, one with prefix reuse (the default) and
one with `--no-prefix-reuse`. Each round runs one conversation on each (the order rotates per
round): every turn adds a user message of about `--new-tokens` tokens (the model's tokenizer
counts them) to the conversation, which the client resends whole, as chat clients do; the
assistant's answers (`--max-tokens`, greedy) go back into it. After each conversation, the last
turn's user message alone (a one-message chat) is sent to the server without reuse: the TTFT of
the turn's new tokens alone.

TTFT is the server's own: the change of `onnx_chunk_time_to_first_token_seconds_sum` on its
/metrics over one request (requests are sequential, so the change is that request's), from its
arrival to its first token from the engine: a first token that decodes to no text (a random-
weight model) does not delay it. `usage.prompt_tokens_details.cached_tokens` gives the tokens
each turn reused.

Goals: the last turn with reuse at least 5x faster than without, and within 1.3x of the new
tokens alone. Printed: per turn the median TTFT of both servers and the cached tokens, then the
ratios (medians over rounds, with their spread), with the load average before and after.

    .venv/bin/python scripts/bench_chat_turns.py [MODEL] [--turns 8] [--new-tokens 150]
        [--max-tokens 16] [--rounds 3] [--batch 2] [--capacity 2048] [--json out.json]

MODEL defaults to the 0.5B-shaped builder export `qwen05-int4` of the bench models
(scripts/_bench/models.py: $ONNX_CHUNK_BENCH_MODELS or ~/.cache/onnx-chunk/bench-models/;
scripts/make_bench_models.py builds it); it needs a tokenizer and a chat template.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from _bench.harness import (
    format_value,
    markdown_table,
    ratio,
    round_order,
    summarize,
    verdict,
)
from _bench.models import BenchModelMissing, model_folder

DEFAULT_MODEL = "qwen05-int4"
SYSTEMS = ("reuse", "no reuse")
TTFT_SUM = "onnx_chunk_time_to_first_token_seconds_sum"
REUSE_GOAL = 5.0
ALONE_GOAL = 1.3
WORDS = ("river mountain letter window garden morning silver market engine question answer "
         "paper travel summer number orange yellow simple follow between little system").split()


class Server:
    """One `onnx-chunk serve` subprocess on a free port."""

    def __init__(self, model: Path, args: argparse.Namespace, *extra: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "onnx_chunk", "serve", str(model), "--port", "0",
             "--provider", args.provider, "--batch", str(args.batch),
             "--capacity", str(args.capacity), *extra],
            stderr=subprocess.PIPE, text=True)
        stderr = self.process.stderr
        assert stderr is not None  # stderr=PIPE
        line = stderr.readline()
        found = re.search(r"http://(\S+:\d+)", line)
        if found is None:
            self.process.kill()
            raise SystemExit(f"the server did not start: {line}{stderr.read()}")
        self.address = found.group(1)

    def metric(self, name: str) -> float:
        connection = http.client.HTTPConnection(self.address, timeout=60)
        try:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        if found is None:
            raise SystemExit(f"the server's /metrics has no {name}")
        return float(found.group(1))

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
        """One greedy chat request: its text, its server-side TTFT, its prompt and cached
        tokens."""
        before = self.metric(TTFT_SUM)
        connection = http.client.HTTPConnection(self.address, timeout=600)
        try:
            connection.request("POST", "/v1/chat/completions", body=json.dumps(
                {"messages": messages, "max_tokens": max_tokens, "temperature": 0}),
                headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            body = json.loads(response.read())
        finally:
            connection.close()
        if response.status != 200:
            raise SystemExit(f"the server answered {response.status}: {body}")
        ttft = self.metric(TTFT_SUM) - before
        usage = body["usage"]
        return (body["choices"][0]["message"]["content"], ttft, usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def user_messages(model: Path, turns: int, new_tokens: int, seed: int) -> list[str]:
    """`turns` distinct user messages of at least `new_tokens` tokens each (the model's
    tokenizer counts them); each seed gives other messages, so no round reuses another's."""
    from onnx_chunk.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model)
    rng = np.random.default_rng(seed)
    messages = []
    for turn in range(turns):
        words = [f"Chat {seed}, turn {turn + 1}:"]
        while len(tokenizer.encode(" ".join(words))) < new_tokens:
            words.append(str(rng.choice(WORDS)))
        messages.append(" ".join(words))
    return messages


def conversation(server: Server, users: list[str], max_tokens: int) -> list[dict]:
    """The turns of one chat: each turn's TTFT, prompt and cached tokens."""
    messages: list[dict] = []
    turns = []
    for user in users:
        messages.append({"role": "user", "content": user})
        text, ttft, prompt, cached = server.chat(messages, max_tokens)
        messages.append({"role": "assistant", "content": text})
        turns.append({"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached})
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="a model folder, or a bench model's name (default qwen05-int4)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--provider", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        args.model = model_folder(args.model)
    except BenchModelMissing as error:
        parser.error(str(error))
    if not (args.model / "tokenizer.json").is_file():
        parser.error(f"{args.model} has no tokenizer.json: pass a model folder with a "
                     "tokenizer and a chat template")
    if args.turns < 1 or args.rounds < 1:
        parser.error("--turns and --rounds must be at least 1")
    load_before = os.getloadavg()
    servers = {"reuse": Server(args.model, args), "no reuse": Server(args.model, args,
                                                                      "--no-prefix-reuse")}
    runs: dict[str, list[list[dict]]] = {system: [] for system in SYSTEMS}
    alone: list[float] = []
    try:
        # A warm-up chat on each server: the first forwards build and warm the sessions.
        for server in servers.values():
            conversation(server, user_messages(args.model, 2, args.new_tokens, 1000), 2)
        for round_index in range(args.rounds):
            for number, system in enumerate(round_order(SYSTEMS, round_index)):
                users = user_messages(args.model, args.turns, args.new_tokens,
                                      2 * round_index + number)
                runs[system].append(conversation(servers[system], users, args.max_tokens))
                alone.append(servers["no reuse"].chat(
                    [{"role": "user", "content": users[-1]}], args.max_tokens)[1])
    finally:
        for server in servers.values():
            server.stop()
    load_after = os.getloadavg()
    print(report(runs, alone, args, load_before, load_after))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {key: str(value) for key, value in
                                                  vars(args).items()},
                                         "load_average": [load_before, load_after],
                                         "runs": runs, "alone_ttft_s": alone}, indent=1))
    return 0


def report(runs: dict[str, list[list[dict]]], alone: list[float], args: argparse.Namespace,
           load_before: tuple[float, ...], load_after: tuple[float, ...]) -> str:
    turns = len(runs["reuse"][0])
    rows = []
    for turn in range(turns):
        reuse = summarize(run[turn]["ttft_s"] * 1000 for run in runs["reuse"])
        plain = summarize(run[turn]["ttft_s"] * 1000 for run in runs["no reuse"])
        rows.append([turn + 1, runs["reuse"][0][turn]["prompt_tokens"],
                     runs["reuse"][0][turn]["cached_tokens"], format_value(reuse, 1),
                     format_value(plain, 1), ratio(plain, reuse)])
    last_reuse = summarize(run[-1]["ttft_s"] for run in runs["reuse"])
    last_plain = summarize(run[-1]["ttft_s"] for run in runs["no reuse"])
    alone_summary = summarize(alone)
    speedup = ratio(last_plain, last_reuse)
    against_alone = ratio(last_reuse, alone_summary)
    load = " / ".join(" ".join(f"{value:.2f}" for value in values)
                      for values in (load_before, load_after))
    lines = [f"{args.model.name}: {turns} turns of about {args.new_tokens} new tokens, "
             f"{args.max_tokens} answer tokens, {args.rounds} rounds (medians, ±spread), "
             f"server batch {args.batch}, capacity {args.capacity}, provider {args.provider}; "
             f"load average before / after: {load}", "",
             markdown_table(["turn", "prompt tokens", "cached tokens", "TTFT reuse ms",
                             "TTFT no reuse ms", "no reuse / reuse"], rows), "",
             markdown_table(["measure", "value", "goal", "verdict"], [
                 [f"turn {turns}: TTFT without reuse / with reuse", speedup,
                  f">= {REUSE_GOAL}", verdict(speedup, REUSE_GOAL, True)],
                 [f"turn {turns}: TTFT with reuse / its new tokens alone", against_alone,
                  f"<= {ALONE_GOAL}", verdict(against_alone, ALONE_GOAL, False)],
                 ["the new tokens alone: TTFT ms", format_value(
                     summarize(value * 1000 for value in alone), 1), "", ""]])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
