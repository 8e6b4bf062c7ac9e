"""The official openai client against a live server: text equals `generate --prompt`."""

from __future__ import annotations

import json

from onnx_chunk.cli import main
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange

NEW_TOKENS = 12
PROMPT = "The capital of France is"


def _generate_cli(capsys, *extra: str) -> dict:
    """`onnx-chunk generate --prompt` (greedy by the export's search defaults), its JSON."""
    code = main(["generate", str(EXPORT), "--provider", "cpu", "--prompt", PROMPT,
                 "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--json", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_completion_equals_generate_prompt(live, capsys):
    expected = _generate_cli(capsys)
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT,
                                              max_tokens=NEW_TOKENS, temperature=0)
    choice = answer.choices[0]
    assert choice.text == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert answer.usage.prompt_tokens == expected["prompt_tokens"]
    assert answer.usage.completion_tokens == len(expected["tokens"])
    assert answer.usage.total_tokens == expected["prompt_tokens"] + len(expected["tokens"])


def test_streamed_completion_equals_generate_prompt(live, capsys):
    expected = _generate_cli(capsys)
    stream = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT,
                                              max_tokens=NEW_TOKENS, temperature=0,
                                              stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) \
        == expected["text"]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] \
        == expected["finish_reason"]
    assert chunks[-1].usage.completion_tokens == len(expected["tokens"])


def test_chat_equals_generate_prompt_chat(live, capsys):
    expected = _generate_cli(capsys, "--chat")
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected["text"]
    assert answer.choices[0].finish_reason == expected["finish_reason"]
    assert answer.usage.prompt_tokens == expected["prompt_tokens"]


def test_streamed_chat_equals_generate_prompt_chat(live, capsys):
    expected = _generate_cli(capsys, "--chat")
    stream = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=NEW_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) \
        == expected["text"]
    assert chunks[-1].choices[0].finish_reason == expected["finish_reason"]


def test_a_stop_string_cuts_the_text_as_generate_does(live, capsys):
    whole = _generate_cli(capsys)["text"]
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    expected = _generate_cli(capsys, "--stop", stop)
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT,
                                              max_tokens=NEW_TOKENS, temperature=0, stop=stop)
    assert answer.choices[0].text == expected["text"] == whole[:whole.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_token_id_prompts_and_seeded_sampling_repeat(live):
    client = live.client()
    ids = tokenizer_of(live.runtime).encode(PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                        temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8,
                                       temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    sampled = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, top_p=0.9, seed=7).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_models_and_health(live):
    models = live.client().models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert exchange(live, "GET", "/health") == (200, {}, {"status": "ok"})
