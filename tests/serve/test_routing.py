"""The prefix-affinity rule on its own (no Ray): prefix digests, affinity, the load guard,
the router's memory of each replica."""

from __future__ import annotations

import json
import random

import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.serve.routing import InFlight, PrefixAffinity, prefix_blocks, request_key

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def _chat(*turns: str) -> str:
    return SYSTEM + "".join(f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"
                            f"answer to {turn}<|im_end|>\n" for turn in turns)


def _router(seed: int = 0, **options) -> PrefixAffinity[str]:
    options = {"memory": 4, "max_excess": 2, **options}
    return PrefixAffinity(rng=random.Random(seed), **options)


def test_prefix_blocks_are_equal_exactly_over_the_shared_whole_blocks():
    first = prefix_blocks("a" * 64 + "b" * 40, 32)
    second = prefix_blocks("a" * 64 + "c" * 40, 32)
    assert len(first) == len(second) == 3  # the partial last block is left out
    assert first[:2] == second[:2]
    assert first[2] != second[2]
    assert prefix_blocks("a" * 31, 32) == ()
    # chained: an equal block after a different one has a different digest
    assert prefix_blocks("x" * 32 + "a" * 32, 32)[1] != prefix_blocks("y" * 32 + "a" * 32, 32)[1]


def test_the_turns_of_a_conversation_return_to_the_replica_that_holds_it():
    replicas = {f"r{index}": 0 for index in range(8)}
    for seed in range(20):
        router = _router(seed)
        first = prefix_blocks(_chat("Tell me about Paris."))
        home = router.choose(first, replicas).replica
        router.record(home, first)
        for turns in range(2, 9):
            blocks = prefix_blocks(_chat("Tell me about Paris.",
                                         *(f"question {n}" for n in range(turns))))
            choice = router.choose(blocks, replicas)
            assert (choice.replica, choice.reason) == (home, "affinity")
            assert choice.matched_blocks >= len(first)
            router.record(choice.replica, blocks)
        assert router.remembered(home) == 1  # each turn replaced the one it extends


def test_the_deepest_match_wins_over_a_shared_system_prompt():
    router = _router()
    router.record("r0", prefix_blocks(SYSTEM + "x" * 64))
    conversation = _chat("What is the capital of France?")
    router.record("r1", prefix_blocks(conversation))
    choice = router.choose(prefix_blocks(conversation + "more text " * 10),
                           {"r0": 0, "r1": 0, "r2": 0})
    assert (choice.replica, choice.reason) == ("r1", "affinity")
    assert choice.matched_blocks == len(prefix_blocks(conversation))


def test_the_load_guard_takes_affinity_up_to_max_excess_over_the_least_loaded_and_no_further():
    blocks = prefix_blocks(_chat("hello there, a long enough first message"))
    router = _router(max_excess=2)
    router.record("r0", blocks)
    assert router.choose(blocks, {"r0": 3, "r1": 1, "r2": 5}).reason == "affinity"
    for seed in range(20):
        router = _router(seed, max_excess=2)
        router.record("r0", blocks)
        choice = router.choose(blocks, {"r0": 4, "r1": 1, "r2": 3})
        assert choice.reason == "balance"
        assert choice.replica != "r0"  # the most loaded never wins two choices


def test_a_hot_prefix_spreads_over_the_replicas_instead_of_piling_on_one():
    hot = prefix_blocks(_chat("the same popular question everyone asks"))

    def route(max_excess: int) -> dict[str, int]:
        router = _router(1, max_excess=max_excess, memory=64)
        loads = {f"r{index}": 0 for index in range(4)}
        for _ in range(100):  # requests that all stay running: the load only grows
            replica = router.choose(hot, loads).replica
            loads[replica] += 1
            router.record(replica, hot)
        return loads

    unguarded = route(max_excess=1000)
    assert sorted(unguarded.values()) == [0, 0, 0, 100]
    guarded = route(max_excess=2)
    assert max(guarded.values()) - min(guarded.values()) <= 6
    assert min(guarded.values()) >= 20


def test_a_prefix_common_to_several_prompts_is_no_affinity():
    router = _router(4)
    for n in range(3):  # three conversations under one system prompt, all on r0
        router.record("r0", prefix_blocks(_chat(f"conversation {n} starts here")))
    loads = {"r0": 0, "r1": 0, "r2": 0, "r3": 0}
    picks = [router.choose(prefix_blocks(_chat(f"a new one, number {n}")), loads)
             for n in range(40)]
    assert {choice.reason for choice in picks} == {"shared"}
    assert {choice.replica for choice in picks} == set(loads)  # spread, not all on r0
    # a conversation's own history still is affinity
    own = router.choose(prefix_blocks(_chat("conversation 1 starts here", "and goes on")), loads)
    assert (own.replica, own.reason) == ("r0", "affinity")


def test_without_a_match_it_is_power_of_two_choices():
    router = _router(3)
    loads = {"r0": 5, "r1": 0, "r2": 5, "r3": 5}
    picks = [router.choose(prefix_blocks(_chat(f"new {n}" * 8)), loads) for n in range(200)]
    assert {choice.reason for choice in picks} == {"no-match"}
    # r1 wins every draw that includes it: half of the ordered pairs (3 of 6 pairs)
    share = sum(choice.replica == "r1" for choice in picks) / len(picks)
    assert 0.35 < share < 0.65
    assert router.stats.no_match == 200


def test_min_match_blocks_ignores_a_shorter_shared_prefix():
    router = _router(2, min_match_blocks=3)
    shared = "s" * 64  # two blocks
    router.record("r0", prefix_blocks(shared + "a" * 64))
    assert router.choose(prefix_blocks(shared + "b" * 64), {"r0": 0, "r1": 0}).reason \
        == "no-match"
    assert router.choose(prefix_blocks(shared + "a" * 96), {"r0": 0, "r1": 0}).reason \
        == "affinity"


def test_the_memory_forgets_the_least_recently_routed_prompt():
    router = _router(memory=2)
    prompts = [prefix_blocks(f"conversation number {n}: " * 8) for n in range(3)]
    for blocks in prompts:
        router.record("r0", blocks)
    assert router.remembered("r0") == 2
    loads = {"r0": 0, "r1": 0}
    assert router.choose(prompts[0], loads).reason == "no-match"
    assert router.choose(prompts[1], loads).reason == "affinity"
    assert router.choose(prompts[2], loads).reason == "affinity"


def test_only_candidates_are_chosen_and_a_replica_that_left_is_forgotten():
    blocks = prefix_blocks(_chat("where is my replica"))
    router = _router()
    router.record("r0", blocks)
    assert router.choose(blocks, {"r1": 0, "r2": 0}).reason == "no-match"
    router.forget("r0")
    assert router.remembered("r0") == 0
    assert router.choose(blocks, {"r0": 0, "r1": 0}).reason == "no-match"


@pytest.mark.parametrize("options", [{"memory": 0}, {"max_excess": -1}, {"memory": True},
                                     {"min_match_blocks": 0}, {"max_excess": 1.5}])
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        _router(**options)


def test_no_candidates_is_a_clear_error():
    with pytest.raises(ConfigError, match="no replica"):
        _router().choose((), {})


def _prompts():
    """The encoder a replica of the test export has by default."""
    from onnx_chunk.text.prompt import PromptEncoder
    from onnx_chunk.text.tokenizer import load_tokenizer
    from tests.serve.conftest import EXPORT

    return PromptEncoder(load_tokenizer(EXPORT), special_in_content=False)


def test_a_chat_key_is_its_rendering_and_the_next_turn_extends_it():
    prompts = _prompts()
    first = [{"role": "user", "content": "Hi there, tell me about lighthouses."}]
    later = first + [{"role": "assistant", "content": "They guide ships."},
                     {"role": "user", "content": "Who keeps them?"}]

    def key(messages: list[dict[str, str]]) -> str:
        return request_key("/v1/chat/completions",
                           json.dumps({"messages": messages}).encode(), prompts)

    assert key(first) == prompts.tokenizer.apply_chat_template(first, add_generation_prompt=True)
    assert key(later).startswith(key(first))
    shared = len(prefix_blocks(key(first)))
    assert shared > 0
    assert prefix_blocks(key(later))[:shared] == prefix_blocks(key(first))


def test_a_completion_key_is_its_prompt_or_its_ids_as_text():
    body = json.dumps({"prompt": "Once upon a time"}).encode()
    assert request_key("/v1/completions", body, None) == "Once upon a time"
    body = json.dumps({"prompt": [5, 17, 3]}).encode()
    assert request_key("/v1/completions", body, None) == "5 17 3 "
    assert request_key("/v1/completions", json.dumps({"prompt": "x" * 100}).encode(), None,
                       max_chars=99) == ""


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b"not json"),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b"[" * 100_000),
    ("/v1/completions", b'{"prompt": 7}'),
    ("/v1/models", b""),
    ("/health", b""),
])
def test_a_body_the_replica_will_refuse_or_another_path_has_no_key(path, body):
    assert request_key(path, body, _prompts()) == ""


def test_a_chat_rendering_over_the_bound_has_no_key():
    messages = [{"role": "user", "content": "y" * 5000}]
    assert request_key("/v1/chat/completions", json.dumps({"messages": messages}).encode(),
                       _prompts(), max_chars=4000) == ""


def test_in_flight_choices_count_until_confirmed_or_expired():
    in_flight: InFlight[str] = InFlight(ttl_s=5.0)
    in_flight.add("a", "r0", now=0.0)
    in_flight.add("b", "r0", now=1.0)
    in_flight.add("c", "r1", now=1.0)
    in_flight.add("c", "r2", now=2.0)  # routed again: the later choice counts
    assert in_flight.counts(now=2.0) == {"r0": 2, "r2": 1}
    in_flight.confirm("b")
    in_flight.confirm("unknown")
    assert in_flight.counts(now=3.0) == {"r0": 1, "r2": 1}
    assert in_flight.counts(now=6.5) == {"r2": 1}  # "a" was never confirmed: dropped
    assert in_flight.counts(now=8.0) == {}


def test_requests_routed_at_once_spread_when_the_router_counts_its_own_choices():
    router = _router(5)
    in_flight: InFlight[str] = InFlight()
    seen = {"r0": 0, "r1": 0}  # the loads the replicas reported: none sent yet
    for chat in range(8):
        loads = dict(seen)
        for replica, count in in_flight.counts(now=0.0).items():
            loads[replica] += count
        choice = router.choose(prefix_blocks(f"chat {chat} " * 10), loads)
        in_flight.add(chat, choice.replica, now=0.0)
    assert in_flight.counts(now=0.0) == {"r0": 4, "r1": 4}
