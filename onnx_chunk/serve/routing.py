"""Prefix-affinity routing over replicas: a request goes where its prompt's prefix is cached,
unless that replica is loaded beyond the others.

Pure logic (no Ray, no HTTP): `onnx_chunk/serve/ray.py` drives it from Ray Serve's request
router, `scripts/simulate_routing.py` from a simulated trace. A replica's engine keeps the KV
of its last few sequences in its slots and reuses the longest common prefix; the router keeps
its own picture of that: the prompts it sent to each replica, the last `memory` of them.

Rules of `PrefixAffinity.choose(blocks, loads)`:
1. A prompt is a sequence of chained block digests (`prefix_blocks`): digest i stands for the
   whole prefix up to block i, so two prompts share a prefix of n blocks iff their first n
   digests are equal.
2. The affinity replicas are the candidates (the keys of `loads`) that hold the deepest prefix
   of the prompt; among them the least loaded (ties: a random one).
3. Affinity needs at least `min_match_blocks` matched blocks, and a prefix that is not common
   to several prompts a replica was sent: a prefix shared by many conversations (a system
   prompt) soon sits on every replica, and preferring the few that hold it first would pile
   conversations onto them (their slots then evict each other's history). Otherwise power of
   two choices.
4. The load guard: the affinity replica is taken only if its load (requests running or queued
   there) is at most the lowest load among the candidates plus `max_excess`; otherwise power
   of two choices (two distinct random candidates, the less loaded): a hot prefix spills over
   to other replicas instead of queueing on one.
`record(replica, blocks)` notes where a prompt went: it replaces the replica's remembered
prompts it extends (the engine's slot that held turn N is the one turn N+1 extends) and
forgets the least recently used beyond `memory`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from onnx_chunk.errors import ConfigError, OnnxChunkError
from onnx_chunk.serve.prompts import chat_options
from onnx_chunk.serve.requests import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from onnx_chunk.text.prompt import PromptEncoder

R = TypeVar("R", bound=Hashable)

# Characters a block of a text key spans (about 8 tokens of a BPE vocabulary).
BLOCK_CHARS = 32
_DIGEST_BYTES = 8
# The longest prompt (characters) given a key: longer ones are routed by load alone, which
# bounds the router's work and memory per request.
MAX_KEY_CHARS = 1 << 20


def prefix_blocks(key: str, block_chars: int = BLOCK_CHARS) -> tuple[bytes, ...]:
    """The chained digests of `key`'s whole blocks of `block_chars` characters: digest i is a
    hash of key[: (i + 1) * block_chars] (a partial last block is left out)."""
    digests: list[bytes] = []
    previous = b""
    for start in range(0, len(key) - block_chars + 1, block_chars):
        block = key[start:start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=_DIGEST_BYTES).digest()
        digests.append(previous)
    return tuple(digests)


@dataclass(frozen=True)
class Choice(Generic[R]):
    """A routing decision: the replica, the prompt blocks it holds, and why it was chosen
    ("affinity"; "balance": the affinity replica was too loaded; "shared": the prefix matched
    is common to several prompts; "no-match")."""

    replica: R
    matched_blocks: int
    reason: str


@dataclass
class RoutingStats:
    """Decisions counted by reason."""

    affinity: int = 0
    balance: int = 0
    shared: int = 0
    no_match: int = 0


class PrefixAffinity(Generic[R]):
    """The routing rule (module docstring); one instance per router, not thread-safe."""

    def __init__(self, *, memory: int, max_excess: int, min_match_blocks: int = 1,
                 rng: random.Random | None = None) -> None:
        for name, value, low in (("memory", memory, 1), ("max_excess", max_excess, 0),
                                 ("min_match_blocks", min_match_blocks, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        self.memory = memory
        self.max_excess = max_excess
        self.min_match_blocks = min_match_blocks
        self.stats = RoutingStats()
        self._rng = rng or random.Random()
        # digest -> {replica: remembered prompts of that replica holding it}
        self._index: dict[Hashable, dict[R, int]] = {}
        # replica -> its remembered prompts, least recently used first (keyed by last digest)
        self._remembered: dict[R, OrderedDict[Hashable, tuple[Hashable, ...]]] = {}

    def choose(self, blocks: Sequence[Hashable], loads: Mapping[R, int]) -> Choice[R]:
        """The replica for a prompt of `blocks`, among the candidates `loads` (replica ->
        requests running or queued there)."""
        if not loads:
            raise ConfigError("no replica to route to: the candidate loads are empty")
        holders, depth, shared = self._deepest_holders(blocks, loads)
        if depth < self.min_match_blocks:
            self.stats.no_match += 1
            return Choice(self.power_of_two(loads), depth, "no-match")
        if shared:
            self.stats.shared += 1
            return Choice(self.power_of_two(loads), depth, "shared")
        target = self._least_loaded(holders, loads)
        if loads[target] <= min(loads.values()) + self.max_excess:
            self.stats.affinity += 1
            return Choice(target, depth, "affinity")
        self.stats.balance += 1
        return Choice(self.power_of_two(loads), depth, "balance")

    def power_of_two(self, loads: Mapping[R, int]) -> R:
        """Two distinct random candidates, the less loaded (the first drawn on a tie)."""
        candidates = list(loads)
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(candidates, 2)
        return second if loads[second] < loads[first] else first

    def record(self, replica: R, blocks: Sequence[Hashable]) -> None:
        """Note that a prompt of `blocks` went to `replica` (module docstring)."""
        if not blocks:
            return
        remembered = self._remembered.setdefault(replica, OrderedDict())
        for digest in blocks:
            extended = remembered.pop(digest, None)
            if extended is not None:
                self._unindex(replica, extended)
        entry = tuple(blocks)
        remembered[entry[-1]] = entry
        for digest in entry:
            holders = self._index.setdefault(digest, {})
            holders[replica] = holders.get(replica, 0) + 1
        while len(remembered) > self.memory:
            _, oldest = remembered.popitem(last=False)
            self._unindex(replica, oldest)

    def forget(self, replica: R) -> None:
        """Drop everything remembered of `replica` (it left)."""
        for entry in self._remembered.pop(replica, {}).values():
            self._unindex(replica, entry)

    def remembered(self, replica: R) -> int:
        """Prompts remembered for `replica`."""
        return len(self._remembered.get(replica, ()))

    def _deepest_holders(self, blocks: Sequence[Hashable], loads: Mapping[R, int]
                         ) -> tuple[list[R], int, bool]:
        """The candidates holding the deepest prefix of `blocks`, its depth, and whether a
        replica holds it in several remembered prompts (a prefix common to prompts)."""
        holders: list[R] = []
        depth, prompts = 0, 0
        for index, digest in enumerate(blocks):
            held = self._index.get(digest, {})
            found = [replica for replica in held if replica in loads]
            if not found:
                break
            holders, depth, prompts = found, index + 1, max(held.values())
        return holders, depth, prompts > 1

    def _least_loaded(self, replicas: list[R], loads: Mapping[R, int]) -> R:
        lowest = min(loads[replica] for replica in replicas)
        return self._rng.choice([replica for replica in replicas if loads[replica] == lowest])

    def _unindex(self, replica: R, entry: tuple[Hashable, ...]) -> None:
        for digest in entry:
            holders = self._index[digest]
            holders[replica] -= 1
            if not holders[replica]:
                del holders[replica]
                if not holders:
                    del self._index[digest]


class InFlight(Generic[R]):
    """Choices made and not yet confirmed (the request sent to the replica and accepted),
    counted into the loads: requests routed at the same instant then spread instead of all
    seeing the same loads. A choice unconfirmed after `ttl_s` (its request was cancelled
    before it was sent) is dropped."""

    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s
        self._choices: dict[Hashable, tuple[R, float]] = {}

    def add(self, request: Hashable, replica: R, now: float) -> None:
        """`request` was routed to `replica` (a later choice for it replaces this one)."""
        self._choices[request] = (replica, now)

    def confirm(self, request: Hashable) -> None:
        """`request` reached its replica: the replica's own count has it now."""
        self._choices.pop(request, None)

    def counts(self, now: float) -> dict[R, int]:
        """Unconfirmed choices per replica."""
        expired = [request for request, (_, when) in self._choices.items()
                   if now - when > self.ttl_s]
        for request in expired:
            del self._choices[request]
        counts: dict[R, int] = {}
        for replica, _ in self._choices.values():
            counts[replica] = counts.get(replica, 0) + 1
        return counts


def request_key(path: str, body: bytes, prompts: PromptEncoder | None, *,
                max_chars: int = MAX_KEY_CHARS) -> str:
    """The text a request's prompt starts with, as the replica's engine will hold it: a chat's
    messages rendered by the replica's encoder (`prompts`: the same special-token policy; the
    tools the replica shows the template, the request's template, variables and generation
    prompt), a completion's prompt, or its token ids written as text (a prompt cut by
    `truncate_prompt_tokens` starts elsewhere: no key). "" (no affinity: power of two
    choices) for other paths, a body the replica will refuse, or a prompt over `max_chars`
    characters; the replica gives the answer, the key only steers where it is computed."""
    try:
        if path.endswith("/chat/completions"):
            if prompts is None:
                return ""
            chat = ChatCompletionRequest.parse(json.loads(body))
            options = chat_options(chat.options.chat, prompts)
            key = prompts.render_text(chat.template_messages(), max_chars=max_chars,
                                      tools=chat.options.template_tools, chat=options)
            keep = chat.options.truncate_prompt_tokens
            return key if keep is None else ""
        if path.endswith("/completions"):
            completion = CompletionRequest.parse(json.loads(body))
            if completion.options.truncate_prompt_tokens is not None:
                return ""
            prompt = completion.prompts()[0]
            key = prompt if isinstance(prompt, str) else "".join(f"{i} " for i in prompt)
            return key if len(key) <= max_chars else ""
    except (OnnxChunkError, ValueError, RecursionError, MemoryError):
        return ""
    return ""
