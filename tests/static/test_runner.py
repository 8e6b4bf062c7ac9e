"""The static runner: greedy tokens equal the dynamic model's, chunked equals whole, and the
sliding window beyond C equals a NumPy reference."""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.errors import CapacityError, ConfigError, InputError, ModelStructureError
from onnx_chunk.models.config import config_for
from onnx_chunk.models.static_decoder import reference_forward
from onnx_chunk.models.weights import make_weights
from onnx_chunk.runtime import load
from onnx_chunk.runtime.device.provider import device_for
from onnx_chunk.sampling import Sampler, Sampling
from onnx_chunk.static.alignment import StaticLimits, align_prompt
from onnx_chunk.static.graphs import GraphRunner, window_capacity_problem
from onnx_chunk.static.mask import mask_fill_value
from onnx_chunk.static.runner import StaticRunner

from .static_sizes import CAPACITY, CHUNK, MAX_INPUT, SEED


@pytest.fixture(scope="module")
def graphs(static_models):
    """The chunk graph (rows c) and the decode graph (rows 1) of one seed and capacity."""
    return static_models(CHUNK, CAPACITY, SEED), static_models(1, CAPACITY, SEED)


@pytest.fixture(scope="module")
def runner(graphs):
    return StaticRunner(*graphs, max_input_len=MAX_INPUT, provider="cpu")


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, length).tolist()


@pytest.fixture(scope="module")
def fixed_runner(fixed_pair):
    """The runner on fix-shapes output: GroupQueryAttention bound at capacity."""
    return StaticRunner(fixed_pair / "chunk.onnx", fixed_pair / "decode.onnx",
                        max_input_len=MAX_INPUT, provider="cpu")


@pytest.mark.parametrize("kind", ["runner", "fixed_runner"])
@pytest.mark.parametrize("length", [1, 3, 4, 6, 9, 16])
def test_greedy_tokens_equal_the_dynamic_models(request, dynamic_greedy, length, kind):
    runner = request.getfixturevalue(kind)
    prompt = _prompt(length, seed=length)
    max_new = CAPACITY - MAX_INPUT
    result = runner.generate(prompt, max_new)
    assert result.tokens == dynamic_greedy(SEED, prompt, max_new)
    assert result.chunks == -(-length // CHUNK)
    assert result.pad_count == result.aligned_len - length
    assert result.decode_steps == max_new - 1
    assert (result.truncated_tokens, result.dropped_positions, result.warnings) == (0, 0, [])


def test_chunked_prefill_equals_one_whole_static_forward(runner, graphs, static_models):
    whole = StaticRunner(static_models(MAX_INPUT, CAPACITY, SEED), graphs[1],
                         max_input_len=MAX_INPUT, provider="cpu")
    for length in (MAX_INPUT, 11):
        prompt = _prompt(length, seed=100 + length)
        chunked, single = runner.generate(prompt, 6), whole.generate(prompt, 6)
        assert chunked.tokens == single.tokens
        assert (chunked.chunks, single.chunks) == (-(-length // CHUNK), 1)
        assert single.pad_count == MAX_INPUT - length


def test_truncation_warns_with_the_numbers_and_strict_refuses(runner, graphs,
                                                              dynamic_greedy, caplog):
    prompt = _prompt(21, seed=5)
    with caplog.at_level(logging.WARNING):
        result = runner.generate(prompt, 4)
    assert result.truncated_tokens == 5 and result.aligned_len == MAX_INPUT
    assert "truncated by 5 of 21" in result.warnings[0]
    assert "first 5 tokens" in caplog.text
    assert result.tokens == dynamic_greedy(SEED, prompt[5:], 4)
    strict = StaticRunner(*graphs, max_input_len=MAX_INPUT, provider="cpu", strict=True)
    with pytest.raises(CapacityError, match="first 5 tokens"):
        strict.generate(prompt, 4)


def _sliding_window_tokens(prompt, max_new, generated):
    """Greedy tokens of a NumPy whole-sequence forward in which each position attends to the
    real positions of the last C seen by the forward that computed it (chunks of c, then 1)."""
    config = config_for("tiny")
    aligned = align_prompt(prompt, StaticLimits(MAX_INPUT, CHUNK, CAPACITY))
    fed = np.array(generated[:-1], dtype=np.int64)
    ids = np.concatenate([aligned.input_ids, fed])
    valid = np.concatenate([aligned.valid, np.ones(len(fed), bool)])
    positions = np.concatenate([aligned.position_ids,
                                aligned.kept_len + np.arange(len(fed), dtype=np.int64)])
    total = len(ids)
    forward_end = np.empty(total, dtype=np.int64)
    for start in range(0, aligned.aligned_len, CHUNK):
        forward_end[start:start + CHUNK] = start + CHUNK
    forward_end[aligned.aligned_len:] = np.arange(aligned.aligned_len, total) + 1
    query, key = np.arange(total)[:, None], np.arange(total)[None, :]
    allowed = (key <= query) & (key >= forward_end[:, None] - CAPACITY) & valid[None, :]
    mask = np.where(allowed, 0.0, mask_fill_value(np.float32)).astype(np.float32)[None, None]
    empty = [np.zeros((1, 2, 0, 16), np.float32)] * config.num_layers
    weights = make_weights(config, SEED)
    logits = reference_forward(config, weights, ids[None], positions[None], mask, empty, empty)[0]
    causal = np.where((key <= query) & valid[None, :], 0.0,
                      mask_fill_value(np.float32)).astype(np.float32)[None, None]
    unwindowed = reference_forward(config, weights, ids[None], positions[None], causal, empty,
                                   empty)[0]
    rows = np.arange(aligned.aligned_len - 1, total)
    return logits[0, rows].argmax(-1).tolist(), np.abs(logits - unwindowed).max()


def test_beyond_capacity_the_cache_is_a_reported_sliding_window(runner):
    prompt = _prompt(14, seed=9)
    max_new = 20  # 14 + 19 fed-back positions > C = 24
    result = runner.generate(prompt, max_new)
    assert result.dropped_positions == 14 + max_new - 1 - CAPACITY
    assert any("sliding window" in warning for warning in result.warnings)
    expected, window_effect = _sliding_window_tokens(prompt, max_new, result.tokens)
    assert result.tokens == expected
    assert window_effect > 1e-3  # the window changed the logits: this test can tell


def test_strict_mode_refuses_a_request_that_would_slide(graphs):
    strict = StaticRunner(*graphs, max_input_len=MAX_INPUT, provider="cpu", strict=True)
    with pytest.raises(CapacityError, match="capacity is C=24"):
        strict.generate(_prompt(14), 12)
    assert len(strict.generate(_prompt(14), 11).tokens) == 11


def test_fix_shapes_output_cannot_slide_so_a_request_past_capacity_is_refused(fixed_runner):
    prompt = _prompt(14, seed=9)
    with pytest.raises(CapacityError, match="cannot slide"):
        fixed_runner.generate(prompt, CAPACITY - 14 + 2)
    assert len(fixed_runner.generate(prompt, CAPACITY - 14 + 1).tokens) == CAPACITY - 14 + 1


def test_a_decode_graph_of_the_other_layout_is_refused(fixed_pair, graphs):
    with pytest.raises(ModelStructureError, match="layout"):
        StaticRunner(fixed_pair / "chunk.onnx", graphs[1], provider="cpu")


def test_eos_stops_generation(runner):
    prompt = _prompt(6, seed=2)
    first = runner.generate(prompt, 5)
    assert first.finish_reason == "length" and len(first.tokens) == 5
    stopped = runner.generate(prompt, 5, eos_token_id=first.tokens[1])
    assert stopped.tokens == first.tokens[:2] and stopped.decode_steps == 1
    assert stopped.finish_reason == "stop"


def test_any_of_several_eos_ids_stops_generation_even_as_the_last_token(runner):
    prompt = _prompt(6, seed=2)
    tokens = runner.generate(prompt, 5).tokens
    absent = next(token for token in range(256) if token not in tokens)
    for ends in ([absent, tokens[2]], (tokens[2], absent), np.array([absent, tokens[2]])):
        stopped = runner.generate(prompt, 5, eos_token_id=ends)
        assert stopped.tokens == tokens[:tokens.index(tokens[2]) + 1]
        assert stopped.finish_reason == "stop"
    last = runner.generate(prompt, 5, eos_token_id=[absent, tokens[4]])
    assert last.tokens == tokens[:tokens.index(tokens[4]) + 1]
    assert last.finish_reason == "stop"
    assert runner.generate(prompt, 5, eos_token_id=[]).finish_reason == "length"


@pytest.mark.parametrize("eos, words", [(-1, "at least 0"), (256, "at most 255"),
                                        ([3, 256], "at most 255"), ("3", "pass ints"),
                                        ([3, 4.0], "must be an integer")])
def test_bad_eos_ids_are_refused_before_anything_runs(graphs, monkeypatch, eos, words):
    runner = StaticRunner(*graphs, max_input_len=MAX_INPUT, provider="cpu")
    monkeypatch.setattr(GraphRunner, "run", _no_forward)
    with pytest.raises(InputError, match=words):
        runner.generate(_prompt(6), 3, eos_token_id=eos)


def test_logprobs_are_refused_before_anything_runs(graphs, monkeypatch):
    runner = StaticRunner(*graphs, max_input_len=MAX_INPUT, provider="cpu")
    monkeypatch.setattr(GraphRunner, "run", _no_forward)
    for sampling in (Sampling(logprobs=0), Sampling(prompt_logprobs=2)):
        with pytest.raises(InputError, match="tokens only"):
            runner.generate(_prompt(6), 3, sampling=sampling)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        runner.generate(_prompt(6), 3, sampling=Sampling(logit_bias={300: 1.0}))


def _no_forward(*args, **kwargs):
    raise AssertionError("a forward ran before the request was checked")


SAMPLED = Sampling(temperature=1.5, top_p=0.95, repetition_penalty=1.3, seed=11)


@pytest.mark.parametrize("kind", ["runner", "fixed_runner"])
def test_sampled_tokens_are_the_samplers_draws_from_each_steps_logits(request, kind):
    runner = request.getfixturevalue(kind)
    prompt = _prompt(7, seed=4)
    new = 8
    result = runner.decode(runner.start(prompt, new), new, sampling=SAMPLED, keep_logits=True)
    replay = Sampler(SAMPLED, runner.vocab_size)
    replay.observe(prompt)
    assert result.tokens == [replay.choose(logits) for logits in result.step_logits]
    assert runner.generate(prompt, new, sampling=SAMPLED).tokens == result.tokens
    assert result.tokens != runner.generate(prompt, new).tokens  # it did sample
    greedy = runner.generate(prompt, new, sampling=Sampling()).tokens
    assert greedy == runner.generate(prompt, new).tokens


def _holding_its_next_token(runner: StaticRunner) -> list[int]:
    """A prompt that holds its own greedy next token: a repetition penalty moves that token
    only if the prompt's ids count as seen."""
    for seed in range(200):
        prompt = _prompt(MAX_INPUT, seed=seed)
        if runner.generate(prompt, 1).tokens[0] in prompt:
            return prompt
    raise AssertionError("none of 200 prompts holds its greedy next token")


@pytest.mark.parametrize("kind", ["runner", "fixed_runner"])
def test_sampled_and_penalised_tokens_equal_a_dynamic_sequences(request, dynamic_models, kind):
    runner = request.getfixturevalue(kind)
    runtime = load(dynamic_models(SEED), provider="cpu")
    sequence = runtime.open_sequence()
    prompt = _holding_its_next_token(runner)
    new = CAPACITY - MAX_INPUT
    penalised = Sampling(repetition_penalty=100.0)
    for sampling in (SAMPLED, penalised):
        sequence.rewind(sequence.length)
        theirs = sequence.generate(prompt, new, [], sampling=sampling)
        assert runner.generate(prompt, new, sampling=sampling).tokens == theirs
    # The penalty reaches the prompt's ids: it moves the first token off the greedy one.
    assert runner.generate(prompt, 1, sampling=penalised).tokens != \
        runner.generate(prompt, 1).tokens
    runtime.close()


def test_one_binding_per_graph_is_reused_and_keeps_no_finished_requests_buffers(
        fixed_pair, monkeypatch):
    made = []
    io_binding = ort.InferenceSession.io_binding

    def counted(session):
        made.append(session)
        return io_binding(session)

    monkeypatch.setattr(ort.InferenceSession, "io_binding", counted)
    runner = StaticRunner(fixed_pair / "chunk.onnx", fixed_pair / "decode.onnx",
                          max_input_len=MAX_INPUT, provider="cpu")
    prompt = _prompt(9, seed=7)
    prefill = runner.start(prompt, 6)
    first = runner.decode(prefill, 6)
    assert first.chunks == 3 and first.decode_steps == 5
    assert len(made) == 2 and made[0] is not made[1]  # one per graph, for 8 forwards
    cache = [weakref.ref(buffer.value) for buffer in (*prefill.cache.key_buffers,
                                                      *prefill.cache.value_buffers)]
    del prefill
    gc.collect()
    assert all(ref() is None for ref in cache)
    assert runner.generate(prompt, 6).tokens == first.tokens
    assert len(made) == 2


def test_parameter_checks_come_up_front(graphs, static_models):
    chunk, decode = graphs
    with pytest.raises(ConfigError, match="no room"):
        StaticRunner(chunk, decode, max_input_len=CAPACITY, provider="cpu")
    with pytest.raises(ConfigError, match="not a multiple"):
        StaticRunner(chunk, decode, max_input_len=10, provider="cpu")
    with pytest.raises(ConfigError, match="C >= L"):
        StaticRunner(chunk, decode, max_input_len=28, provider="cpu")
    default = StaticRunner(chunk, decode, provider="cpu")
    assert default.limits.max_input_len == 20
    with pytest.raises(ModelStructureError, match="take 1"):
        StaticRunner(chunk, chunk, provider="cpu")
    with pytest.raises(ModelStructureError, match="same capacity"):
        StaticRunner(chunk, static_models(1, 32, SEED), provider="cpu")
    with pytest.raises(InputError, match="vocabulary"):
        default.generate([3, 999], 2)
    with pytest.raises(InputError, match="max_new_tokens"):
        default.generate([3, 4], 0)


def test_a_window_sized_cache_wider_than_its_window_is_refused_where_the_kernel_needs_equality():
    cpu, cuda = device_for("cpu"), device_for("cuda")  # described, never opened
    assert window_capacity_problem({32}, 512, cpu) is None
    assert window_capacity_problem(set(), 512, cuda) is None
    assert window_capacity_problem({512}, 512, cuda) is None
    problem = window_capacity_problem({32}, 512, cuda)
    assert "window 32" in problem and "--capacity 32" in problem and "--provider cpu" in problem


def test_a_window_sized_cache_shorter_than_its_window_is_refused_everywhere():
    for device in (device_for("cpu"), device_for("cuda")):  # described, never opened
        problem = window_capacity_problem({32, 4096}, 512, device)
        assert "window 4096" in problem and "--capacity 4096 or more" in problem
