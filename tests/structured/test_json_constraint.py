"""JSON schema constraints on real exports: sampled output (temperature 1, random-weight
decoders: adversaries with no wish to write JSON) always parses and validates."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from onnx_chunk.errors import InputError
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from onnx_chunk.structured import json_constraint
from onnx_chunk.text.generation import generate_text
from onnx_chunk.text.tokenizer import TOKENIZER_FILE, tokenizer_of
from tests.exports.corpus import ROOT

EXPORTS = ("genai-qwen3-fp32", "genai-llama-fp32", "genai-phi3-int4")

# Bounded, so that a random model reaches the end: strings with maxLength, integers in a range,
# enums, an optional nested object, an array with maxItems.
SCHEMAS = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "where": {"type": "object", "properties": {"zip": {"type": "string",
                                                           "pattern": "^[0-9]{5}$"}},
                  "required": ["zip"], "additionalProperties": False}},
        "required": ["name", "age", "kind", "ok", "tags"], "additionalProperties": False},
    "choice": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                         {"type": "array", "items": {"enum": [1, "a", None]}, "minItems": 1,
                          "maxItems": 4}]},
}


@pytest.fixture(scope="module", params=EXPORTS)
def runtime(request):
    with load(ROOT / request.param) as runtime:
        yield runtime


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_output_always_validates(runtime, name):
    schema = SCHEMAS[name]
    constraint = json_constraint(tokenizer_of(runtime), schema, runtime.stats.vocab_size)
    for seed in range(25):
        completion = generate_text(
            runtime, "Write anything:", 200,
            sampling=Sampling(temperature=1.0, seed=seed, constraint=constraint))
        assert completion.finish_reason == "stop", (seed, completion)
        jsonschema.validate(json.loads(completion.text), schema)


def test_free_sampling_of_these_models_is_not_json(runtime):
    # The property above is the grammar's doing: unconstrained, the same draws are not JSON.
    parsed = 0
    for seed in range(10):
        text = generate_text(runtime, "Write anything:", 40,
                             sampling=Sampling(temperature=1.0, seed=seed)).text
        try:
            json.loads(text)
            parsed += 1
        except json.JSONDecodeError:
            pass
    assert parsed < 3


def test_json_object_mode_gives_an_object(runtime):
    constraint = json_constraint(tokenizer_of(runtime), {"type": "object"},
                                 runtime.stats.vocab_size)
    sampling = Sampling(temperature=1.0, constraint=constraint, logit_bias={})
    ends = 0
    for seed in range(10):
        completion = generate_text(runtime, "{", 60, sampling=replace(sampling, seed=seed))
        if completion.finish_reason == "stop":
            ends += 1
            assert isinstance(json.loads(completion.text), dict)
        else:  # cut by max_new_tokens: still a prefix of an object
            assert completion.text.startswith("{")
    assert ends > 0


def test_the_mask_is_the_grammar_libraries_bitmask(runtime):
    # The numpy unpacking against llguidance's own bitmask, bit by bit, along a generation.
    import llguidance

    tokenizer, vocab = tokenizer_of(runtime), runtime.stats.vocab_size
    constraint = json_constraint(tokenizer, SCHEMAS["record"], vocab)
    matcher = constraint.matcher()
    # The library's own matcher, over a tokenizer it reads itself from the model folder.
    words = llguidance.LLTokenizer((tokenizer.folder / TOKENIZER_FILE).read_text(encoding="utf-8"),
                                   n_vocab=tokenizer.vocab_size,
                                   eos_token=list(tokenizer.eos_token_ids))
    reference = llguidance.LLMatcher(words, constraint.grammar, log_level=0)
    rng = np.random.default_rng(0)
    for _ in range(30):
        scores = np.zeros(vocab)
        matcher.restrict(scores)
        bits = reference.compute_bitmask()
        allowed = {word for word in range(tokenizer.vocab_size)
                   if bits[word // 8] >> (word % 8) & 1}
        assert set(np.flatnonzero(np.isfinite(scores)).tolist()) == allowed
        if matcher.accepting and reference.is_stopped():
            break
        token = int(rng.choice(sorted(allowed)))
        matcher.advance(token)
        assert reference.consume_token(token)


def test_ids_beyond_the_tokenizer_are_forbidden(runtime):
    tokenizer = tokenizer_of(runtime)
    constraint = json_constraint(tokenizer, {"type": "object"}, tokenizer.vocab_size + 40)
    scores = np.zeros(tokenizer.vocab_size + 40)
    constraint.matcher().restrict(scores)
    assert np.isneginf(scores[tokenizer.vocab_size:]).all()
    assert np.isfinite(scores[:tokenizer.vocab_size]).any()


@pytest.mark.parametrize("schema", [{"type": "nonsense"}, {"type": "string", "pattern": "(("},
                                    {"$ref": "#/nowhere"}])
def test_a_bad_schema_is_an_input_error(runtime, schema):
    with pytest.raises(InputError):
        json_constraint(tokenizer_of(runtime), schema, runtime.stats.vocab_size)
