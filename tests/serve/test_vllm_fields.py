"""vLLM's request fields through the official openai client's `extra_body`, each shown to take
effect on the corpus's Qwen3 export (the live server of tests/serve/conftest.py, and a copy of
the export whose chat template has Qwen3's thinking switch)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from onnx_chunk.serve.logprobs import TokenStrings
from onnx_chunk.text.generation import generate_text
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.full_forward import full_sequence_logprobs
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange, live_server

PROMPT = [5, 17, 200, 42, 99, 7, 100, 23, 55, 61]
USER = [{"role": "user", "content": "The capital of France is"}]
# Qwen3's switch: with enable_thinking false the generation prompt holds an empty thought.
THINKING_SWITCH = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is "
    "false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


def _tokenize(live, **body) -> list[int]:
    status, _, answer = exchange(live, "POST", "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def _completion(live, prompt, **extra):
    return live.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                            temperature=0, extra_body=extra or None)


def _ids(logprobs) -> list[int]:
    """The token ids of logprobs named "token_id:N"."""
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A copy of the Qwen3 export whose chat template switches thinking off on request."""
    folder = tmp_path_factory.mktemp("thinking") / EXPORT.name
    shutil.copytree(EXPORT, folder)
    (folder / "chat_template.jinja").write_text(THINKING_SWITCH)
    with load(folder, provider="cpu", max_batch=2) as runtime, live_server(runtime) as live:
        yield live


def test_chat_template_kwargs_change_the_rendering(thinking):
    client = thinking.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4,
                                           temperature=0)
    switched = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=4, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = tokenizer_of(thinking.runtime).apply_chat_template(USER) + "<think>\n\n</think>\n\n"
    ids = tokenizer_of(thinking.runtime).encode(rendered, add_special_tokens=False)
    assert switched.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    assert _tokenize(thinking, messages=USER,
                     chat_template_kwargs={"enable_thinking": False}) == ids
    expected = _completion(thinking, ids, max_tokens=4).choices[0].text
    assert switched.choices[0].message.content == expected


def test_a_request_chat_template_renders_in_the_same_sandbox(trusting):
    live = trusting
    template = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
        extra_body={"chat_template": template + "{{ greeting }}ASSISTANT:",
                    "chat_template_kwargs": {"greeting": "Hi. "}})
    ids = tokenizer_of(live.runtime).encode("USER: The capital of France is\nHi. ASSISTANT:",
                                            add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(ids)
    expected = live.client().completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6,
                                                temperature=0).choices[0].text
    assert answer.choices[0].message.content == expected


def test_add_generation_prompt_false_leaves_out_the_assistant_header(live):
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False})
    tokenizer = tokenizer_of(live.runtime)
    ids = tokenizer.encode(tokenizer.apply_chat_template(USER, add_generation_prompt=False),
                           add_special_tokens=False)
    with_header = tokenizer.encode(tokenizer.apply_chat_template(USER),
                                   add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(ids) < len(with_header)
    assert answer.choices[0].message.content == _completion(live, ids, max_tokens=4
                                                            ).choices[0].text


def test_an_answer_continues_a_prefilled_assistant_message(live):
    messages = [*USER, {"role": "assistant", "content": "Paris, and the"}]
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    tokenizer = tokenizer_of(live.runtime)
    rendered = tokenizer.apply_chat_template(USER, add_generation_prompt=True) + "Paris, and the"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert _tokenize(live, messages=messages, continue_final_message=True) == ids
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == _completion(live, ids, max_tokens=6
                                                            ).choices[0].text


def test_stop_strings_are_kept_with_include_stop_str_in_output(live):
    whole = _completion(live, PROMPT, max_tokens=12).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = _completion(live, PROMPT, max_tokens=12, stop=[stop])
    kept = _completion(live, PROMPT, max_tokens=12, stop=[stop],
                       include_stop_str_in_output=True)
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert kept.choices[0].text == whole[:whole.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_special_tokens_are_shown_with_skip_special_tokens_false(live):
    special = tokenizer_of(live.runtime).token_id("<|im_start|>")
    forced = {"logit_bias": {str(special): 100}, "ignore_eos": True}
    hidden = _completion(live, PROMPT, max_tokens=3, **forced).choices[0].text
    shown = _completion(live, PROMPT, max_tokens=3, skip_special_tokens=False, **forced)
    assert hidden == "" and shown.choices[0].text == "<|im_start|>" * 3
    # This byte-level tokenizer puts no space between special tokens, so vLLM's
    # spaces_between_special_tokens changes nothing here (tests/text/test_vllm_text.py shows a
    # decoder that does).
    joined = _completion(live, PROMPT, max_tokens=3, skip_special_tokens=False,
                         spaces_between_special_tokens=False, **forced)
    assert joined.choices[0].text == "<|im_start|>" * 3


def test_allowed_token_ids_are_the_only_ones_produced(live):
    allowed = [40, 41, 300]
    answer = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True,
                    "ignore_eos": True})
    produced = _ids(answer.choices[0].logprobs)
    assert len(produced) == 20 and set(produced) <= set(allowed)
    assert len(set(produced)) > 1  # a draw among them, not one forced id


def test_bad_words_are_never_produced(live):
    tokenizer = tokenizer_of(live.runtime)
    # Three word pieces of this vocabulary: "en", "st", "it"; "sten" is "st" then "en".
    allowed = [265, 266, 292]
    assert [tokenizer.decode([token]) for token in allowed] == ["en", "st", "it"]
    assert tokenizer.encode("sten", add_special_tokens=False) == [266, 265]

    def produced(**extra) -> list[int]:
        answer = live.client().completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3,
            logprobs=0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                                    "allowed_token_ids": allowed, **extra})
        return _ids(answer.choices[0].logprobs)

    def pairs(ids: list[int]) -> set[tuple[int, int]]:
        return set(zip(ids, ids[1:]))

    free = produced()
    assert 292 in free and (266, 265) in pairs(free)  # both occur unless banned
    banned = produced(bad_words=["sten", "it"])
    assert len(banned) == 40 and 292 not in banned and (266, 265) not in pairs(banned)
    assert 266 in banned and 265 in banned  # each piece alone still comes


def test_a_truncated_prompt_keeps_its_last_tokens(live):
    long = PROMPT * 5
    answer = _completion(live, long, truncate_prompt_tokens=7, echo=True)
    assert answer.usage.prompt_tokens == 7
    tail = _completion(live, long[-7:], echo=True)
    assert answer.choices[0].text == tail.choices[0].text
    assert answer.choices[0].text.startswith(tokenizer_of(live.runtime).decode(long[-7:]))
    text = tokenizer_of(live.runtime).decode(long)
    assert _completion(live, text, truncate_prompt_tokens=7).usage.prompt_tokens == 7
    chat = live.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_truncation_to_the_context_serves_a_prompt_too_long_for_it(live):
    capacity = live.runtime.stats.capacity
    long = (PROMPT * 300)[:capacity + 50]
    status, _, answer = exchange(live, "POST", "/v1/completions", {
        "prompt": long, "max_tokens": 8, "temperature": 0})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    kept = _completion(live, long, truncate_prompt_tokens=-1)
    assert kept.usage.prompt_tokens == capacity - 8
    assert kept.choices[0].text == _completion(live, long[-(capacity - 8):]).choices[0].text


def test_bad_words_are_encoded_as_vllm_encodes_them(live):
    from onnx_chunk.serve.parameters import bad_words_ids

    tokenizer = tokenizer_of(live.runtime)
    vocab = live.runtime.stats.vocab_size
    plain = tuple(tokenizer.encode("un", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" un", add_special_tokens=False))
    assert len(plain) == len(spaced) and plain[0] != spaced[0]  # both forms are banned
    assert bad_words_ids(("un", "  un"), tokenizer, vocab) == (plain, spaced)
    sten = tuple(tokenizer.encode("sten", add_special_tokens=False))
    assert len(tokenizer.encode(" sten", add_special_tokens=False)) != len(sten)
    assert bad_words_ids(("sten",), tokenizer, vocab) == (sten,)  # a longer spaced form: not


def test_prompt_logprobs_are_a_full_forwards(live):
    answer = _completion(live, PROMPT, max_tokens=1, prompt_logprobs=3)
    shown = answer.choices[0].prompt_logprobs
    reference = full_sequence_logprobs(EXPORT, PROMPT)
    assert len(shown) == len(PROMPT) and shown[0] is None
    tokens = TokenStrings(tokenizer_of(live.runtime))
    for position in range(1, len(PROMPT)):
        row = reference[position - 1]
        entries = {int(token): entry for token, entry in shown[position].items()}
        own = entries[PROMPT[position]]
        assert abs(own["logprob"] - row[PROMPT[position]]) <= 1e-4
        assert own["rank"] == int(np.count_nonzero(row >= row[PROMPT[position]]))
        assert own["decoded_token"] == tokens(PROMPT[position])
        best = sorted(entries.values(), key=lambda entry: entry["rank"])[0]
        assert best["rank"] == 1 and abs(best["logprob"] - row.max()) <= 1e-4
        assert 3 <= len(entries) <= 4
    chat = live.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(position) == 1 for position in chat.prompt_logprobs[1:])


def test_tokens_are_named_by_id_with_return_tokens_as_token_ids(live):
    named = _completion(live, PROMPT, logprobs=2, return_tokens_as_token_ids=True)
    plain = _completion(live, PROMPT, logprobs=2)
    ids = _ids(named.choices[0].logprobs)
    strings = TokenStrings(tokenizer_of(live.runtime))
    assert [strings(token) for token in ids] == plain.choices[0].logprobs.tokens
    assert all(key.startswith("token_id:") for top in named.choices[0].logprobs.top_logprobs
               for key in top)
    chat = live.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=3, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)


def test_typical_p_is_the_python_apis(live, served_runtime):
    answer = live.client().completions.create(
        model=MODEL_NAME, prompt="Paris is", max_tokens=10, temperature=1.0, seed=9,
        extra_body={"typical_p": 0.2, "ignore_eos": True})
    expected = generate_text(served_runtime, "Paris is", 10, sampling=Sampling(
        temperature=1.0, seed=9, typical_p=0.2), ignore_eos=True)
    free = generate_text(served_runtime, "Paris is", 10, sampling=Sampling(
        temperature=1.0, seed=9), ignore_eos=True)
    assert answer.choices[0].text == expected.text != free.text


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(live):
    """vLLM's stream_options: `include_usage` defaults to true once the object is sent, and
    `continuous_usage_stats` puts the choice's usage so far in every chunk."""
    client = live.client()
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [chunk.usage for chunk in chunks]
    assert all(usage is not None for usage in counted)
    assert all(usage.prompt_tokens == len(PROMPT) for usage in counted)
    done = [usage.completion_tokens for usage in counted]
    # so far: none in the opening chunk, then rising to the 6 made (pieces ready together
    # come in one chunk, so how many steps between is the engine's timing)
    assert done == sorted(done) and done[0] == 0 and done[-1] == 6
    assert all(usage.total_tokens == len(PROMPT) + usage.completion_tokens
               for usage in counted)
    plain = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                           temperature=0, stream=True, stream_options={}))
    assert [chunk.usage is not None for chunk in plain] == [False] * (len(plain) - 1) + [True]
    unasked = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": None, "continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in unasked)


@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True, "stream_options": {"include_usage": True, "per_chunk": True}},
     "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_stream_options_outside_a_stream_or_with_unknown_keys_are_a_400(live, body, param):
    status, _, answer = exchange(live, "POST", "/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert "per_chunk" in answer["error"]["message"] or "per_chunk" not in str(body)


def test_an_empty_stream_options_outside_a_stream_is_none():
    """vLLM refuses stream_options without a stream only when the object holds a key."""
    from onnx_chunk.serve.requests import CompletionRequest

    request = CompletionRequest.parse({"prompt": "a", "stream": False, "stream_options": {}})
    assert not request.options.include_usage and not request.options.stream


def test_the_answer_id_carries_the_request_id(live):
    for path, body, prefix in (
            ("/v1/chat/completions", {"messages": USER}, "chatcmpl"),
            ("/v1/completions", {"prompt": PROMPT}, "cmpl")):
        status, _, answer = exchange(live, "POST", path,
                                     {**body, "max_tokens": 2, "request_id": "job-17"})
        assert status == 200 and answer["id"] == f"{prefix}-job-17", answer
        for unset in ({}, {"request_id": ""}):  # none, or empty: a random id (vLLM's)
            status, _, answer = exchange(live, "POST", path, {**body, "max_tokens": 2, **unset})
            assert status == 200 and answer["id"].startswith(f"{prefix}-")
            assert len(answer["id"]) > len(prefix) + 8 and "job-17" not in answer["id"]
    status, _, answer = exchange(live, "POST", "/v1/completions",
                                 {"prompt": PROMPT, "request_id": "x" * 257})
    assert status == 400 and answer["error"]["param"] == "request_id", answer


def test_an_assistant_messages_reasoning_reaches_the_template_under_both_names(live):
    """vLLM's chat_utils gives an assistant message's `reasoning` (or `reasoning_content`)
    under both names: Qwen3's template reads `reasoning_content`."""
    from onnx_chunk.serve.requests import ChatCompletionRequest

    for field in ("reasoning", "reasoning_content"):
        request = ChatCompletionRequest.parse({"messages": [
            *USER, {"role": "assistant", "content": "Paris", field: "It is Paris."}]})
        assert request.template_messages()[1] == {
            "role": "assistant", "content": "Paris", "reasoning": "It is Paris.",
            "reasoning_content": "It is Paris."}
    status, _, answer = exchange(live, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x", "reasoning": "no"}], "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "messages[0].reasoning", answer


def test_min_tokens_past_the_room_the_context_leaves_is_a_400(live):
    """With no length field the output's length is the room the context leaves (vLLM's
    rule): `min_tokens` past it is refused, naming it."""
    capacity = live.runtime.stats.capacity
    status, _, answer = exchange(live, "POST", "/v1/completions",
                                 {"prompt": PROMPT, "min_tokens": capacity})
    assert status == 400 and answer["error"]["param"] == "min_tokens", answer
    assert str(capacity - len(PROMPT)) in answer["error"]["message"]


def test_a_schema_refused_through_llama_cpps_json_schema_names_that_field(live):
    """A schema the grammar library refuses is named as the client sent it: llama.cpp's
    `json_schema`, not `response_format`."""
    status, _, answer = exchange(live, "POST", "/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 2, "json_schema": True})
    assert status == 400 and answer["error"]["param"] == "json_schema", answer
