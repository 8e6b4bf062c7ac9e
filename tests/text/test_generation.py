"""Text in, text out on a runtime: prompts, messages, sampling, stops, EOS and capacity."""

from __future__ import annotations

import json
import shutil

import pytest

from onnx_chunk import Sampling
from onnx_chunk.errors import CapacityError, InputError, ModelLoadError
from onnx_chunk.runtime import load
from onnx_chunk.text.generation import generate_text, stream_text
from onnx_chunk.text.tokenizer import tokenizer_of

PROMPT = "Hello, world! Größe 日本"


@pytest.fixture(scope="module")
def greedy(text_runtime):
    return generate_text(text_runtime, PROMPT, 24)


def _model_copy(text_model, tmp_path, **genai_changes):
    folder = tmp_path / "model"
    shutil.copytree(text_model.parent, folder)
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    for section, values in genai_changes.items():
        config[section].update(values)
    config_path.write_text(json.dumps(config))
    return folder / "model.onnx"


def test_greedy_text_is_the_decode_of_the_greedy_ids(text_runtime, greedy):
    tokenizer = tokenizer_of(text_runtime)
    ids = tokenizer.encode(PROMPT)
    assert greedy.prompt_tokens == len(ids) and ids[0] == tokenizer.bos_token_id
    assert list(greedy.tokens) == text_runtime.open_sequence().generate(ids, 24)
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 24
    assert greedy.text == tokenizer.decode(greedy.tokens, skip_special_tokens=True)
    assert greedy.stats.prompt_tokens == len(ids) and greedy.stats.new_tokens == 24


def test_the_stream_adds_up_to_the_completion(text_runtime, greedy):
    pieces = list(stream_text(text_runtime, PROMPT, 24))
    assert "".join(pieces) == greedy.text and len(pieces) > 1


def test_messages_go_through_the_chat_template(text_runtime):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokenizer = tokenizer_of(text_runtime)
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered.endswith("<|im_start|>assistant\n")
    completion = generate_text(text_runtime, messages, 4)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert completion.prompt_tokens == len(ids)
    assert list(completion.tokens) == text_runtime.open_sequence().generate(ids, 4)


def test_seeded_sampling_repeats_and_interleaved_requests_keep_their_own(text_runtime, greedy):
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=5)
    first = generate_text(text_runtime, PROMPT, 24, sampling=sampling)
    assert generate_text(text_runtime, PROMPT, 24, sampling=sampling) == first
    assert first.tokens != greedy.tokens
    assert generate_text(text_runtime, PROMPT, 24, sampling=Sampling(
        temperature=1.0, top_p=0.95, seed=6)).tokens != first.tokens
    assert generate_text(text_runtime, PROMPT, 24, sampling=Sampling(
        temperature=0.7, top_k=1, seed=1)).tokens == greedy.tokens
    one, two = (stream_text(text_runtime, PROMPT, 24, sampling=sampling) for _ in range(2))
    pieces = {0: [], 1: []}
    for a, b in zip(one, two):
        pieces[0].append(a)
        pieces[1].append(b)
    pieces[0] += list(one)
    pieces[1] += list(two)
    assert "".join(pieces[0]) == "".join(pieces[1]) == first.text


def test_a_stop_string_cuts_the_text_and_ends_the_generation(text_runtime, greedy):
    text = greedy.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    completion = generate_text(text_runtime, PROMPT, 24, stop=["never there", stop])
    assert completion.finish_reason == "stop"
    assert completion.text == text[:text.find(stop)]
    assert len(completion.tokens) < 24
    assert completion.tokens == greedy.tokens[:len(completion.tokens)]
    assert "".join(stream_text(text_runtime, PROMPT, 24, stop=stop)) == completion.text


def test_an_eos_id_ends_the_generation_and_stays_out_of_the_text(text_model, tmp_path, greedy):
    eos = greedy.tokens[5]
    unused = next(token for token in range(500, 0, -1) if token not in greedy.tokens)
    runtime = load(_model_copy(text_model, tmp_path, model={"eos_token_id": [unused, eos]}),
                   provider="cpu", capacity=512, chunk_size=32)
    assert tokenizer_of(runtime).eos_token_ids == (unused, eos)
    completion = generate_text(runtime, PROMPT, 24)
    cut = greedy.tokens.index(eos) + 1
    assert completion.finish_reason == "stop" and completion.tokens == greedy.tokens[:cut]
    assert completion.text == tokenizer_of(runtime).decode(greedy.tokens[:cut - 1],
                                                           skip_special_tokens=True)


def test_genai_search_defaults_apply_unless_sampling_is_given(text_model, tmp_path, greedy):
    path = _model_copy(text_model, tmp_path, search={"do_sample": True, "temperature": 1.0,
                                                     "top_k": 0, "random_seed": 9})
    runtime = load(path, provider="cpu", capacity=512, chunk_size=32)
    sampled = generate_text(runtime, PROMPT, 24)
    assert sampled == generate_text(runtime, PROMPT, 24) and sampled.tokens != greedy.tokens
    assert sampled.tokens == generate_text(runtime, PROMPT, 24, sampling=Sampling(
        temperature=1.0, seed=9)).tokens
    assert generate_text(runtime, PROMPT, 24, sampling=Sampling()).tokens == greedy.tokens


def test_capacity_ends_a_generation_that_would_not_fit(text_model):
    runtime = load(text_model, provider="cpu", capacity=40, chunk_size=32)
    prompt_tokens = len(tokenizer_of(runtime).encode(PROMPT))
    completion = generate_text(runtime, PROMPT, 100)
    assert completion.finish_reason == "capacity"
    assert len(completion.tokens) == 40 - prompt_tokens
    with pytest.raises(CapacityError):
        generate_text(runtime, "word " * 60, 5)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"prompt": [], "max_new_tokens": 3}, InputError, "non-empty list"),
    ({"prompt": "hi", "max_new_tokens": 0}, InputError, "at least 1"),
    ({"prompt": "hi", "max_new_tokens": 3, "stop": [""]}, InputError, "non-empty"),
    ({"prompt": [{"role": "robot", "content": "x"}], "max_new_tokens": 3}, InputError,
     "Unknown role: robot"),
])
def test_bad_requests_fail_before_any_work(text_runtime, kwargs, error, message):
    with pytest.raises(error, match=message):
        stream_text(text_runtime, **kwargs)


def test_a_model_without_a_tokenizer_runs_ids_and_refuses_text(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=16)
    assert len(runtime.open_sequence().generate([1, 2, 3], 3)) == 3
    with pytest.raises(ModelLoadError, match="has no tokenizer.json"):
        generate_text(runtime, "hi", 3)
