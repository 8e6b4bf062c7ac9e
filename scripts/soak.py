"""A bounded load test of `onnx-chunk serve` on loopback: does serving stay flat?

For each variant-cache mode, a server is started (`onnx-chunk serve --cache MODE`, a
subprocess on a free port), `--clients` threads send `--requests` streamed completions of
random token-id prompts (lengths drawn uniformly from 1 to `--max-prompt`, capped at the
context minus `--max-tokens`), and the script stops by itself. Modes:
- auto: the provider's default (CPU: one shape-generic session; CUDA: the ladder);
- ladder: a variant per ladder tier, remainders padded up (the CUDA default, forced);
- exact: a variant per distinct width, padding off (the per-shape cache that thrashes).

Printed per mode: every `--every` requests, the cumulative compiles, evictions and live
variants (the server's /metrics) and the server process's RSS (VmRSS in /proc/PID/status);
then throughput, TTFT and inter-token p50/p99 (measured by the clients: from sending a request
to its first text event, and between its events) and errors. The first `--warmup` requests are
the warm-up; targets: 0 errors, 0 compiles after the warm-up, RSS at the end within 5% of RSS
after the warm-up. Exit 1 when any mode had errors, or (in a full run) when a mode other than
exact misses a target.

`--chat-mix F`: each client holds a conversation, and with probability F its next request
resends that conversation's prompt with 16 to 200 new ids after it (capped by the longest
prompt) instead of taking the next fresh prompt: the server's prefix reuse serves these from
the KV a slot kept. Then the targets add prefix hits (the server's /metrics) and the report
gives the prompt tokens reused (each response's `usage.prompt_tokens_details.cached_tokens`).

    .venv/bin/python scripts/soak.py [MODEL] [--requests 2000] [--clients 8] [--quick]
        [--chat-mix 0.5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from _bench.harness import markdown_table, seeded_prompt

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"
MODES = ("auto", "ladder", "exact")
RSS_TOLERANCE = 0.05
QUICK = {"requests": 60, "clients": 4, "max_prompt": 600, "warmup": 20, "every": 20,
         "max_tokens": 8}


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt_tokens: int
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    continued: bool = False
    error: str | None = None


@dataclass
class Checkpoint:
    requests: int
    compiles: int
    evictions: int
    variants: int
    rss_mib: float
    prefix_hits: int = 0


def one_request(connection: http.client.HTTPConnection, ids: list[int],
                max_tokens: int) -> Outcome:
    """Stream one completion; its TTFT, the gaps between its events, its error if any."""
    outcome = Outcome(prompt_tokens=len(ids))
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body,
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        outcome.error = f"HTTP {response.status}: {response.read()[:200]!r}"
        return outcome
    last, done = None, False
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            outcome.error = event["error"]["message"]
            continue
        if event.get("usage"):
            outcome.completion_tokens = event["usage"]["completion_tokens"]
            outcome.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
        if not event["choices"] or not event["choices"][0]["text"]:
            continue
        now = time.perf_counter()
        if last is None:
            outcome.ttft_s = now - sent
        else:
            outcome.gaps_s.append(now - last)
        last = now
    if not done and outcome.error is None:
        outcome.error = "the stream ended without [DONE]"
    return outcome


def scrape(address: str) -> dict[str, float]:
    """The server's /metrics as {sample name: value} (unlabelled samples)."""
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def rss_mib(pid: int) -> float:
    """The resident set of process `pid` now (VmRSS), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    if found is None:
        raise SystemExit(f"/proc/{pid}/status has no VmRSS")
    return int(found.group(1)) / 1024


class Soak:
    """One mode's run: the server, the clients, the checkpoints."""

    def __init__(self, model: Path, mode: str, args: argparse.Namespace, vocab: int,
                 longest: int) -> None:
        self.model, self.mode, self.args = model, mode, args
        self.vocab, self.longest = vocab, longest
        self.outcomes: list[Outcome] = []
        self.checkpoints: list[Checkpoint] = []
        self._lock = threading.Lock()
        self._next = 0

    def run(self, prompts: list[list[int]]) -> dict:
        server = subprocess.Popen(
            [sys.executable, "-m", "onnx_chunk", "serve", str(self.model), "--port", "0",
             "--provider", self.args.provider, "--batch", str(self.args.batch),
             "--queue", str(max(self.args.clients, 1)), "--cache", self.mode],
            stderr=subprocess.PIPE, text=True)
        stderr = server.stderr
        assert stderr is not None  # stderr=PIPE
        try:
            line = stderr.readline()
            found = re.search(r"http://(\S+:\d+)", line)
            if found is None:
                raise SystemExit(f"the server did not start: {line}{stderr.read()}")
            self.address, self.pid = found.group(1), server.pid
            started = time.perf_counter()
            clients = [threading.Thread(target=self._client, args=(prompts, number))
                       for number in range(self.args.clients)]
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            seconds = time.perf_counter() - started
        finally:
            server.terminate()
            code = server.wait(timeout=60)
        return self._summary(seconds, code)

    def _client(self, prompts: list[list[int]], number: int) -> None:
        connection = http.client.HTTPConnection(self.address, timeout=300)
        rng = np.random.default_rng((self.args.seed, number))
        conversation: list[int] = []
        while True:
            with self._lock:
                if self._next >= len(prompts):
                    break
                index = self._next
                ids = prompts[index]
                self._next += 1
            tail = int(rng.integers(16, 201))
            continued = (bool(conversation) and rng.random() < self.args.chat_mix
                         and len(conversation) + tail <= self.longest)
            if continued:
                ids = conversation + seeded_prompt(tail, self.vocab, self.args.seed + index)
            conversation = ids
            try:
                outcome = one_request(connection, ids, self.args.max_tokens)
                outcome.continued = continued
            except (OSError, http.client.HTTPException, ValueError) as error:
                outcome = Outcome(prompt_tokens=len(ids), error=f"{type(error).__name__}: {error}")
                connection.close()
                connection = http.client.HTTPConnection(self.address, timeout=300)
            with self._lock:
                self.outcomes.append(outcome)
                count = len(self.outcomes)
                if count % self.args.every == 0 or count == self.args.warmup:
                    self._checkpoint(count)
        connection.close()

    def _checkpoint(self, count: int) -> None:
        metrics = scrape(self.address)
        self.checkpoints.append(Checkpoint(
            requests=count, compiles=int(metrics["onnx_chunk_variant_compiles_total"]),
            evictions=int(metrics["onnx_chunk_variant_evictions_total"]),
            variants=int(metrics["onnx_chunk_variants"]), rss_mib=rss_mib(self.pid),
            prefix_hits=int(metrics["onnx_chunk_prefix_hits_total"])))

    def _summary(self, seconds: float, exit_code: int) -> dict:
        warm = next(point for point in self.checkpoints if point.requests == self.args.warmup)
        end = self.checkpoints[-1]
        ttft = [outcome.ttft_s for outcome in self.outcomes if outcome.ttft_s is not None]
        gaps = [gap for outcome in self.outcomes for gap in outcome.gaps_s]
        errors = [outcome.error for outcome in self.outcomes if outcome.error]
        tokens = sum(outcome.completion_tokens for outcome in self.outcomes)
        rss_change = (end.rss_mib - warm.rss_mib) / warm.rss_mib
        verdicts = {"errors": "ok" if not errors else "MISS",
                    "compiles": "ok" if end.compiles == warm.compiles else "MISS",
                    "rss": "ok" if abs(rss_change) <= RSS_TOLERANCE else "MISS",
                    "clean exit": "ok" if exit_code == 0 else "MISS"}
        if self.args.chat_mix:
            verdicts["prefix hits"] = "ok" if end.prefix_hits > 0 else "MISS"
        prompt_tokens = sum(outcome.prompt_tokens for outcome in self.outcomes)
        cached = sum(outcome.cached_tokens for outcome in self.outcomes)
        return {
            "mode": self.mode, "requests": len(self.outcomes), "seconds": seconds,
            "requests_per_s": len(self.outcomes) / seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": _percentile(ttft, 50) * 1000,
            "ttft_p99_ms": _percentile(ttft, 99) * 1000,
            "itl_p50_ms": _percentile(gaps, 50) * 1000, "itl_p99_ms": _percentile(gaps, 99) * 1000,
            "errors": len(errors), "first_errors": errors[:3],
            "compiles_after_warmup": end.compiles - warm.compiles,
            "rss_warm_mib": warm.rss_mib, "rss_end_mib": end.rss_mib,
            "rss_change": rss_change, "server_exit_code": exit_code,
            "continued": sum(outcome.continued for outcome in self.outcomes),
            "prefix_hits": end.prefix_hits, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "cached_share": cached / prompt_tokens,
            "verdicts": verdicts,
            "checkpoints": [asdict(point) for point in self.checkpoints],
        }


def _percentile(values: list[float], percent: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


def _prompts(model: Path, args: argparse.Namespace) -> tuple[list[list[int]], int, int]:
    from onnx_chunk.runtime import load

    with load(model, provider="cpu") as runtime:
        capacity, vocab = runtime.stats.capacity, runtime.stats.vocab_size
    longest = min(args.max_prompt, capacity - args.max_tokens)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(1, longest + 1, size=args.requests)
    return [seeded_prompt(int(length), vocab, args.seed + index)
            for index, length in enumerate(lengths)], longest, vocab


def _report(results: list[dict], args: argparse.Namespace, longest: int) -> str:
    lines = [f"{args.requests} requests, {args.clients} clients, prompts of 1 to {longest} "
             f"tokens, {args.max_tokens} new tokens each, server batch {args.batch}, "
             f"provider {args.provider}, chat mix {args.chat_mix}; warm-up: the first "
             f"{args.warmup} requests; load average at the start "
             f"{' '.join(f'{value:.2f}' for value in args.load_average)}", ""]
    for result in results:
        lines += [f"### {result['mode']}", "", markdown_table(
            ["requests", "compiles", "evictions", "variants", "RSS MiB", "prefix hits"],
            [[point["requests"], point["compiles"], point["evictions"], point["variants"],
              round(point["rss_mib"], 1), point["prefix_hits"]]
             for point in result["checkpoints"]]), ""]
    if args.chat_mix:
        lines += [markdown_table(
            ["mode", "continued requests", "prefix hits", "prompt tokens", "cached tokens",
             "cached share"],
            [[result["mode"], result["continued"], result["prefix_hits"],
              result["prompt_tokens"], result["cached_tokens"], result["cached_share"]]
             for result in results]), ""]
    lines += [markdown_table(
        ["mode", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
         "errors", "compiles after warm-up", "RSS warm→end MiB", "verdicts"],
        [[result["mode"], result["requests_per_s"], result["tokens_per_s"],
          result["ttft_p50_ms"], result["ttft_p99_ms"], result["itl_p50_ms"],
          result["itl_p99_ms"], result["errors"], result["compiles_after_warmup"],
          f"{result['rss_warm_mib']:.1f}→{result['rss_end_mib']:.1f} "
          f"({100 * result['rss_change']:+.1f}%)",
          ", ".join(f"{name} {verdict}" for name, verdict in result["verdicts"].items())]
         for result in results])]
    for result in results:
        if result["first_errors"]:
            lines.append(f"{result['mode']}: first errors: {result['first_errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--provider", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes (auto, ladder, exact)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-mix", type=float, default=0.0,
                        help="the share of requests that continue their client's conversation")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="a small run for CI: " + ", ".join(f"{key}={value}"
                                                              for key, value in QUICK.items()))
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not 1 <= args.warmup < args.requests:
        parser.error(f"unknown modes {unknown}" if unknown
                     else "--warmup must be at least 1 and below --requests")
    if not 0.0 <= args.chat_mix <= 1.0:
        parser.error("--chat-mix must be between 0 and 1")
    args.load_average = os.getloadavg()
    prompts, longest, vocab = _prompts(args.model, args)
    results = [Soak(args.model, mode, args, vocab, longest).run(prompts) for mode in modes]
    print(_report(results, args, longest))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {key: str(value) for key, value in
                                                  vars(args).items()}, "results": results},
                                        indent=1))
    failed = any(result["errors"] or result["server_exit_code"] != 0 for result in results)
    missed = any("MISS" in result["verdicts"].values() for result in results
                 if result["mode"] != "exact")
    return 1 if failed or (missed and not args.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
