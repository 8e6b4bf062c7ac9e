"""logprobs, echo, n and prompt lists through the official openai client against the live
server on a real export; every number checked against a plain ONNX Runtime forward of the
whole sequence through the unmodified export (tests/exports/full_forward.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from onnx_chunk.sampling import Sampling
from onnx_chunk.serve.logprobs import FLOOR, TokenStrings
from onnx_chunk.text.prompt import PromptEncoder
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.full_forward import full_sequence_logprobs
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange

TOLERANCE = 1e-4
PROMPT = [5, 17, 200, 42, 99, 7, 100, 23, 55, 61]


def _reference(ids: list[int]) -> np.ndarray:
    return full_sequence_logprobs(EXPORT, ids)


def _greedy(prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The greedy continuation by the reference forward, and the reference's logprobs of the
    whole sequence."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(_reference(ids)[-1])))
    return ids[len(prompt):], _reference(ids)


def test_chat_logprobs_are_the_log_softmax_of_the_exports_logits(live):
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, logprobs=True, top_logprobs=5,
        extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    tokenizer = tokenizer_of(live.runtime)
    prompt = PromptEncoder(tokenizer, special_in_content=False).encode(messages)
    generated, reference = _greedy(prompt, 6)
    strings = TokenStrings(tokenizer)
    for step, entry in enumerate(content):
        row = reference[len(prompt) - 1 + step]
        assert entry.token == strings(generated[step])
        assert abs(entry.logprob - row[generated[step]]) <= TOLERANCE
        assert entry.bytes == list(strings.raw(generated[step]))
        expected = np.sort(row)[::-1][:5]
        assert np.allclose([top.logprob for top in entry.top_logprobs], expected,
                           atol=TOLERANCE)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_completion_logprobs_in_the_legacy_shape(live):
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                              logprobs=3, extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == \
        len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert logprobs.text_offset[0] == 0
    text = answer.choices[0].text
    # Each token's first character in the text (a label `bytes:\\xNN` counts no character).
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] < len(text)
    for offset, token, following in zip(logprobs.text_offset, logprobs.tokens,
                                        [*logprobs.text_offset[1:], len(text)]):
        if not token.startswith("bytes:"):
            assert text[offset:following] == token
    generated = [max(top, key=top.get) for top in logprobs.top_logprobs]
    assert generated == logprobs.tokens  # greedy: each chosen token is its position's top
    assert all(len(top) == 3 for top in logprobs.top_logprobs)


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(live):
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0,
                                              echo=True, logprobs=2)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 0
    assert choice.text == tokenizer_of(live.runtime).decode(PROMPT)
    assert len(logprobs.token_logprobs) == len(PROMPT)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = _reference(PROMPT)
    for position in range(1, len(PROMPT)):
        expected = reference[position - 1, PROMPT[position]]
        assert abs(logprobs.token_logprobs[position] - expected) <= TOLERANCE
        assert len(logprobs.top_logprobs[position]) <= 2
        best = max(logprobs.top_logprobs[position].values())
        assert abs(best - reference[position - 1].max()) <= TOLERANCE


def test_echo_then_generation_over_several_chunks(live):
    """A prompt longer than the chunk width: the prompt's logprobs span several prefill
    chunks, then the generated tokens' follow."""
    width = live.runtime.stats.chunk_size
    prompt = [int(token) for token in np.random.default_rng(3).integers(5, 380, width * 2 + 3)]
    answer = live.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3,
                                              echo=True, logprobs=1,
                                              extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 3
    generated, reference = _greedy(prompt, 3)
    ids = prompt + generated
    expected = [reference[position - 1, ids[position]] for position in range(1, len(ids))]
    assert np.allclose(logprobs.token_logprobs[1:], expected, atol=TOLERANCE)
    assert answer.choices[0].text.startswith(tokenizer_of(live.runtime).decode(prompt))


def test_sampled_logprobs_are_those_of_the_distribution_drawn_from(live):
    """temperature 0.7 and top_k 4: the logprobs are log-softmax(logits / 0.7) over the 4
    kept tokens; the rest are cut (-inf, sent as -9999.0). The same request through the
    Python API and over HTTP."""
    sampling = Sampling(temperature=0.7, top_k=4, seed=5, logprobs=6)
    request = live.runtime.submit(PROMPT, 4, sampling=sampling, eos_token_id=[])
    generated = request.result()
    reference = _reference(PROMPT + generated)
    for step, (token, entry) in enumerate(zip(generated, request.logprobs)):
        row = reference[len(PROMPT) - 1 + step] / 0.7
        kept = np.sort(row)[::-1][:4]
        norm = kept.max() + math.log(np.exp(kept - kept.max()).sum())
        assert entry.token == token
        assert abs(entry.logprob - (row[token] - norm)) <= TOLERANCE
        assert np.allclose([value for _, value in entry.top[:4]], kept - norm, atol=TOLERANCE)
        assert all(value == -math.inf for _, value in entry.top[4:])
    answer = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=5, logprobs=6,
        extra_body={"top_k": 4, "ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert np.allclose(logprobs.token_logprobs, [entry.logprob for entry in request.logprobs],
                       atol=1e-9)
    assert all(FLOOR in top.values() for top in logprobs.top_logprobs)


def test_streamed_logprobs_equal_the_whole_answers(live):
    whole = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                             logprobs=2, echo=True)
    chunks = list(live.client().completions.create(model=MODEL_NAME, prompt=PROMPT,
                                                   max_tokens=6, logprobs=2, echo=True,
                                                   stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key].extend(getattr(chunk.choices[0].logprobs, key))
    assert streamed == whole.choices[0].logprobs.model_dump()
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == \
        whole.choices[0].text
    chat = list(live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        logprobs=True, top_logprobs=1, stream=True))
    entries = [entry for chunk in chat if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert len(entries) == 5


def test_n_choices_each_with_its_own_seed(live):
    client = live.client()
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3,
                                       temperature=1.0, seed=11)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    texts = [choice.text for choice in answer.choices]
    # Choice i is the request with seed 11 + i.
    for index, text in enumerate(texts):
        alone = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                          temperature=1.0, seed=11 + index)
        assert alone.choices[0].text == text
    assert len(set(texts)) > 1
    assert answer.usage.prompt_tokens == len(PROMPT)
    assert answer.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
        temperature=1.0, seed=2, logprobs=True)
    assert [choice.index for choice in chat.choices] == [0, 1]
    assert all(len(choice.logprobs.content) == 4 for choice in chat.choices)


def test_a_prompt_list_gives_each_prompt_n_choices(live):
    prompts = [PROMPT, PROMPT[:4], "Paris is"]
    answer = live.client().completions.create(model=MODEL_NAME, prompt=prompts,
                                              max_tokens=3, n=2, echo=True)
    assert [choice.index for choice in answer.choices] == list(range(6))
    tokenizer = tokenizer_of(live.runtime)
    for choice in answer.choices:
        prompt = prompts[choice.index // 2]
        echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        assert choice.text.startswith(echo)
    alone = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT[:4],
                                             max_tokens=3)
    assert answer.choices[2].text == tokenizer.decode(PROMPT[:4]) + alone.choices[0].text
    assert answer.usage.prompt_tokens == len(PROMPT) + 4 + len(tokenizer.encode("Paris is"))


def test_a_streamed_prompt_list_carries_every_index(live):
    status, _, _ = exchange(live, "GET", "/health")
    assert status == 200
    events = list(live.client().completions.create(
        model=MODEL_NAME, prompt=[PROMPT, PROMPT[:3]], max_tokens=2, n=2, stream=True,
        stream_options={"include_usage": True}))
    finished = {chunk.choices[0].index: chunk.choices[0].finish_reason for chunk in events
                if chunk.choices and chunk.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert events[-1].usage.completion_tokens == 8
    assert json.loads(events[-1].model_dump_json())["usage"]["prompt_tokens"] == \
        len(PROMPT) + 3


def test_n_choices_under_a_json_schema_each_follow_it(live):
    """Each choice has its own sampler and grammar matcher: every one parses and validates."""
    import jsonschema

    from tests.serve.test_dialect import SCHEMA

    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me about Paris."}],
        max_tokens=150, n=3, temperature=1.0, seed=3, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city",
                                                                "schema": SCHEMA}})
    contents = [choice.message.content for choice in answer.choices]
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert len(choice.logprobs.content) > 0
    assert len(set(contents)) > 1


class _Strings:
    """TokenStrings' interface over a fixed table: id -> (label, bytes)."""

    def __init__(self, table: dict[int, tuple[str, bytes]]) -> None:
        self._table = table

    def __call__(self, token: int) -> str:
        return self._table[token][0]

    def raw(self, token: int) -> bytes:
        return self._table[token][1]


def test_text_offset_counts_the_characters_a_split_token_completes_not_its_label():
    from onnx_chunk.sampling import TokenLogprobs
    from onnx_chunk.serve.logprobs import CompletionLogprobs

    # "é" (c3 a9) split over two tokens, then "x", then a whole "ab".
    strings = _Strings({1: ("bytes:\\xc3", b"\xc3"), 2: ("bytes:\\xa9", b"\xa9"),
                        3: ("x", b"x"), 4: ("ab", b"ab")})
    builder = CompletionLogprobs(strings, offset=7)
    part = builder.part([TokenLogprobs(token, -1.0, ()) for token in (1, 2, 3, 4)])
    assert part["text_offset"] == [7, 7, 8, 9]
    assert builder.offset == 11
