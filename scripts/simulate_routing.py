"""Simulate routing chats over many replicas: power of two choices against prefix affinity.

A discrete-event replay of a synthetic chat trace over `--replicas` replicas of `--slots`
engine slots each, once per routing policy on the same trace:
- the trace: conversations arrive as a Poisson process (`--rate` per second); each has a
  number of turns (geometric) and per turn a user message and a response (log-normal token
  counts), with the means a published chat log reports (`--trace`, see TRACES); the user's
  next turn comes a think time (exponential, `--think-s`) after the response ends; a turn
  resends the whole conversation (a system prompt of `--system-tokens`, every earlier
  message and answer, the new message), as chat clients do;
- a replica's engine: a request waits for a free slot (FIFO); it takes the free slot whose
  kept tokens share the longest prefix with its prompt (least recently used on a tie, as the
  engine's prefix reuse does), reuses that prefix (all but the last prompt token at most)
  and prefills the rest; prefills of one replica run one after another at `--prefill-tps`
  tokens/s, each request then decodes in its slot at `--decode-tps` tokens/s (batched decode
  is taken as not slowed by the other slots); a slot keeps its sequence when it ends;
- the router sees each replica's load (requests running or queued there) when a request
  arrives: `power-of-two` is Ray Serve's default, `affinity` is `PrefixAffinity` with the
  load guard (`--max-excess`), `affinity-unguarded` the same rule without the guard.
Reported per rate and policy: the prefix hit rate (prompt tokens reused / prompt tokens), the
share of later turns that found their conversation cached, TTFT p50/p99 (arrival to the end
of its prefill: slot wait, prefill queue, prefill), and the load spread (time-averaged load
of the busiest replica over the mean; requests of the busiest replica over the mean).
Conversations arriving in the first `--warmup` share of the trace are left out of the numbers.
Deterministic for a `--seed`.

    .venv/bin/python scripts/simulate_routing.py [--rates 0.5,1,2] [--replicas 64] [--slots 8]
        [--conversations 4000] [--trace sharegpt|lmsys] [--prefill-tps 80] [--decode-tps 24]
        [--measure MODEL] [--json out.json]

`--measure MODEL` times one request's prefill and decode on MODEL (CPU, one slot, median of
3) and uses those rates instead of `--prefill-tps` / `--decode-tps`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from onnx_chunk.serve.routing import PrefixAffinity


@dataclass(frozen=True)
class Trace:
    """A chat log's published means: turns per conversation, tokens per user message and per
    response."""

    turns: float
    prompt_tokens: float
    response_tokens: float
    source: str


TRACES = {
    "sharegpt": Trace(3.51, 94.46, 348.45, "ShareGPT, as reported in Table 1 of Zheng et al., "
                      "LMSYS-Chat-1M (ICLR 2024, arXiv:2309.11998)"),
    "lmsys": Trace(2.0, 69.5, 214.5, "LMSYS-Chat-1M, Table 1 of Zheng et al. (ICLR 2024, "
                   "arXiv:2309.11998)"),
}
POLICIES = ("power-of-two", "affinity", "affinity-unguarded")


@dataclass(frozen=True)
class Config:
    replicas: int = 64
    slots: int = 8
    rate: float = 1.0
    conversations: int = 4000
    trace: str = "sharegpt"
    sigma: float = 1.0
    think_s: float = 30.0
    system_tokens: int = 0
    context: int = 8192
    prefill_tps: float = 80.0
    decode_tps: float = 24.0
    block_tokens: int = 16
    max_excess: int = 8
    memory: int = 64
    warmup: float = 0.1
    seed: int = 0


@dataclass
class Conversation:
    index: int
    arrival: float
    turns: list[tuple[int, int, float]]  # per turn: user tokens, response tokens, think time


@dataclass
class Request:
    conversation: Conversation
    turn: int
    prompt: int
    response: int
    arrival: float
    reused: int = 0
    ttft: float = 0.0


@dataclass
class Replica:
    index: int
    kept: list[tuple[int, int, float]]  # per slot: (conversation, tokens kept, last used)
    free: list[int]
    queue: deque = field(default_factory=deque)
    prefill_free_at: float = 0.0
    load: int = 0
    area: float = 0.0
    changed: float = 0.0
    requests: int = 0

    def add_load(self, delta: int, now: float) -> None:
        self.area += self.load * (now - self.changed)
        self.changed = now
        self.load += delta


def make_trace(config: Config) -> list[Conversation]:
    """The conversations: Poisson arrivals, geometric turns, log-normal token counts,
    exponential think times (drawn once: every policy replays the same trace)."""
    rng = random.Random(config.seed)
    trace = TRACES[config.trace]
    stop = 1 / trace.turns
    conversations, now = [], 0.0
    for index in range(config.conversations):
        now += rng.expovariate(config.rate)
        turns, length = [], config.system_tokens
        while True:
            user = _lognormal(rng, trace.prompt_tokens, config.sigma)
            response = _lognormal(rng, trace.response_tokens, config.sigma)
            if length + user + response > config.context:
                break
            turns.append((user, response, rng.expovariate(1 / config.think_s)))
            length += user + response
            if rng.random() < stop:
                break
        if turns:
            conversations.append(Conversation(index, now, turns))
    return conversations


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def simulate(config: Config, policy: str, conversations: list[Conversation]) -> dict:
    """One policy over the trace; the summary of its requests after the warm-up."""
    rng = random.Random(config.seed + 1)
    excess = config.max_excess if policy == "affinity" else 1 << 30
    rule: PrefixAffinity[int] = PrefixAffinity(memory=config.memory, max_excess=excess, rng=rng)
    replicas = [Replica(index, [(-1, 0, 0.0)] * config.slots, list(range(config.slots)))
                for index in range(config.replicas)]
    cutoff = _cutoff(config, conversations)
    events = _Events()
    for conversation in conversations:
        events.push(conversation.arrival, _request(config, conversation, 0,
                                                   conversation.arrival))
    done: list[Request] = []
    while events:
        now, item = events.pop()
        if isinstance(item, Request):  # an arrival
            loads = {replica.index: replica.load for replica in replicas}
            if policy == "power-of-two":
                target = rule.power_of_two(loads)
            else:
                blocks = _blocks(config, item)
                target = rule.choose(blocks, loads).replica
                rule.record(target, blocks)
            replica = replicas[target]
            replica.add_load(1, now)
            replica.requests += item.conversation.arrival >= cutoff
            replica.queue.append(item)
        else:  # a request ends on (replica, slot)
            assert isinstance(item, tuple)
            request, index, slot = item
            done.append(request)
            replica = replicas[index]
            follow = _finish(config, replica, request, slot, now)
            if follow is not None:
                events.push(follow.arrival, follow)
        for finish, started in admit(config, replica, now):
            events.push(finish, started)
    return _summary(config, policy, conversations, done, replicas, rule)


class _Events:
    """A time-ordered queue; equal times pop in push order (deterministic)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._count = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, time: float, item: object) -> None:
        self._count += 1
        heapq.heappush(self._heap, (time, self._count, item))

    def pop(self) -> tuple[float, object]:
        time, _, item = heapq.heappop(self._heap)
        return time, item


def _request(config: Config, conversation: Conversation, turn: int, now: float) -> Request:
    history = sum(user + response for user, response, _ in conversation.turns[:turn])
    user, response, _ = conversation.turns[turn]
    return Request(conversation, turn, config.system_tokens + history + user, response, now)


def _blocks(config: Config, request: Request) -> tuple:
    """The router's key: one digest per whole block of `block_tokens` (shared system blocks,
    then the conversation's own)."""
    size, system = config.block_tokens, config.system_tokens
    return tuple(("system", block) if (block + 1) * size <= system
                 else (request.conversation.index, block)
                 for block in range(request.prompt // size))


def admit(config: Config, replica: Replica, now: float) -> list[tuple[float, tuple]]:
    """Start queued requests on free slots: (finish time, (request, replica, slot)) each."""
    started = []
    while replica.queue and replica.free:
        request = replica.queue.popleft()
        slot = max(replica.free, key=lambda free: (_shared(config, replica.kept[free], request),
                                                   -replica.kept[free][2]))
        replica.free.remove(slot)
        request.reused = min(_shared(config, replica.kept[slot], request), request.prompt - 1)
        begin = max(now, replica.prefill_free_at)
        replica.prefill_free_at = begin + (request.prompt - request.reused) / config.prefill_tps
        request.ttft = replica.prefill_free_at - request.arrival
        finish = replica.prefill_free_at + request.response / config.decode_tps
        started.append((finish, (request, replica.index, slot)))
    return started


def _shared(config: Config, kept: tuple[int, int, float], request: Request) -> int:
    conversation, tokens, _ = kept
    if conversation == request.conversation.index:
        return min(tokens, request.prompt)
    return min(config.system_tokens, tokens, request.prompt) if conversation >= 0 else 0


def _finish(config: Config, replica: Replica, request: Request, slot: int,
            now: float) -> Request | None:
    """End a request: its slot keeps the sequence; the conversation's next turn, if any."""
    replica.kept[slot] = (request.conversation.index, request.prompt + request.response, now)
    replica.free.append(slot)
    replica.add_load(-1, now)
    if request.turn + 1 >= len(request.conversation.turns):
        return None
    think = request.conversation.turns[request.turn][2]
    return _request(config, request.conversation, request.turn + 1, now + think)


def _cutoff(config: Config, conversations: list[Conversation]) -> float:
    return conversations[-1].arrival * config.warmup if conversations else 0.0


def _summary(config: Config, policy: str, conversations: list[Conversation],
             done: list[Request], replicas: list[Replica], rule: PrefixAffinity) -> dict:
    cutoff = _cutoff(config, conversations)
    measured = [request for request in done if request.conversation.arrival >= cutoff]
    later = [request for request in measured if request.turn > 0]
    ttft = sorted(request.ttft for request in measured)
    end = max(replica.changed for replica in replicas)
    mean_load = [replica.area / end for replica in replicas] if end else [0.0]
    counts = [replica.requests for replica in replicas]
    decisions = max(1, rule.stats.affinity + rule.stats.balance + rule.stats.no_match)
    return {
        "rate": config.rate, "policy": policy, "requests": len(measured),
        "hit_rate": sum(r.reused for r in measured) / max(1, sum(r.prompt for r in measured)),
        "later_turns_cached": sum(r.reused > config.system_tokens for r in later)
        / max(1, len(later)),
        "ttft_p50_s": _quantile(ttft, 0.50), "ttft_p99_s": _quantile(ttft, 0.99),
        "load_max_over_mean": max(mean_load) / max(1e-9, statistics.fmean(mean_load)),
        "requests_max_over_mean": max(counts) / max(1e-9, statistics.fmean(counts)),
        "guard_fallbacks": rule.stats.balance / decisions if policy != "power-of-two" else 0.0,
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def measure(model: Path, prompt_tokens: int = 512, new_tokens: int = 32) -> tuple[float, float]:
    """Prefill and decode tokens/s of one request on `model` (CPU, one slot; medians of 3
    after a warm-up)."""
    import onnx_chunk

    vocab = 1000
    prompt = [random.Random(7).randrange(10, vocab) for _ in range(prompt_tokens)]
    with onnx_chunk.load(model, provider="cpu", max_batch=1,
                         capacity=prompt_tokens + new_tokens) as runtime:
        runtime.submit(prompt[:8], 2, eos_token_id=[]).result()
        prefill, decode = [], []
        for _ in range(3):
            request = runtime.submit(prompt, new_tokens, eos_token_id=[])
            request.result()
            ttft, rate = request.stats.ttft_s, request.stats.decode_tokens_per_s
            assert ttft is not None and rate is not None  # more than one token, EOS off
            prefill.append(prompt_tokens / ttft)
            decode.append(rate)
    return statistics.median(prefill), statistics.median(decode)


def table(results: list[dict]) -> str:
    """The results as a markdown table."""
    lines = ["| conv/s | policy | requests | prefix hit rate | later turns cached | TTFT p50 s | "
             "TTFT p99 s | load max/mean | requests max/mean | guard fallbacks |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results:
        lines.append(
            f"| {row['rate']:g} | {row['policy']} | {row['requests']} | {row['hit_rate']:.1%} "
            f"| {row['later_turns_cached']:.1%} | {row['ttft_p50_s']:.2f} | "
            f"{row['ttft_p99_s']:.2f} | {row['load_max_over_mean']:.2f} | "
            f"{row['requests_max_over_mean']:.2f} | {row['guard_fallbacks']:.1%} |")
    return "\n".join(lines)


def run(config: Config, rates: list[float], policies: tuple[str, ...] = POLICIES) -> list[dict]:
    """Every policy at every rate, each on the same trace for a rate."""
    results = []
    for rate in rates:
        at_rate = replace(config, rate=rate)
        conversations = make_trace(at_rate)
        for policy in policies:
            results.append(simulate(at_rate, policy, conversations))
            print(f"rate {rate:g} {policy}: done", file=sys.stderr)
    return results


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2",
                        help="conversation arrival rates per second, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--trace", choices=sorted(TRACES), default=defaults.trace)
    parser.add_argument("--measure", type=Path, metavar="MODEL",
                        help="time prefill and decode on this model instead of the rates given")
    parser.add_argument("--json", type=Path, help="write the results (and the config) here")
    for name, value in asdict(defaults).items():
        if name not in ("rate", "trace"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = _arguments(argv)
    fields = {name: getattr(options, name) for name in asdict(Config()) if name != "rate"}
    config = Config(rate=1.0, **fields)
    policies = tuple(options.policies.split(","))
    unknown = set(policies) - set(POLICIES)
    try:
        rates = [float(rate) for rate in options.rates.split(",")]
    except ValueError:
        rates = []
    if unknown or not rates or min(rates) <= 0:
        print(f"error: --rates takes positive numbers and --policies some of "
              f"{', '.join(POLICIES)}; got {options.rates!r} and {options.policies!r}",
              file=sys.stderr)
        return 2
    if options.measure is not None:
        prefill, decode = measure(options.measure)
        config = replace(config, prefill_tps=prefill, decode_tps=decode)
        print(f"measured on {options.measure}: prefill {prefill:.1f} tokens/s, decode "
              f"{decode:.1f} tokens/s", file=sys.stderr)
    results = run(config, rates, policies)
    trace = TRACES[config.trace]
    print(f"trace: {config.trace} ({trace.source}): {trace.turns} turns, {trace.prompt_tokens} "
          f"tokens per message, {trace.response_tokens} per response; {config.replicas} "
          f"replicas x {config.slots} slots; prefill {config.prefill_tps:.1f} tokens/s, decode "
          f"{config.decode_tps:.1f} tokens/s per sequence; seed {config.seed}\n")
    print(table(results))
    if options.json is not None:
        options.json.write_text(json.dumps({"config": asdict(config), "results": results},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
