"""Chunked prefill equals one whole-prompt forward; KV stays at capacity in one buffer."""

import numpy as np
import pytest

from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.models.reference import ReferenceDecoder
from onnx_chunk.passes import convert_model
from onnx_chunk.runtime import load
from onnx_chunk.runtime.engine.scheduler import prefill_chunks

W = 16
CAPACITY = 256
LENGTHS = [1, W - 1, W, W + 1, 2 * W + 13, 2 * W + 113]


def _prompt(length, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def _load(path, **options):
    options.setdefault("capacity", CAPACITY)
    options.setdefault("specialize", True)  # the ladder's variants (CPU defaults to one)
    return load(path, provider="cpu", **options)


@pytest.fixture(scope="module")
def base(reference_model):
    return reference_model("base")


@pytest.fixture(scope="module")
def whole(base):
    return _load(base, chunk_size=CAPACITY, padding=False)


@pytest.fixture(scope="module")
def chunked(base):
    return _load(base, chunk_size=W, padding=False)


@pytest.fixture(scope="module")
def padded(base):
    return _load(base, chunk_size=W, padding=True)


@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_logits_and_kv_are_byte_identical_to_one_forward(whole, chunked, padded, length):
    prompt = _prompt(length)
    reference = whole.open_sequence()
    expected = reference.prefill(prompt, all_logits=True)
    assert expected.shape == (length, 256)
    for runtime in (chunked, padded):
        sequence = runtime.open_sequence()
        got = sequence.prefill(prompt, all_logits=True)
        assert np.array_equal(got, expected)
        assert sequence.length == length
        for ours, theirs in zip(sequence.buffers.kv, reference.buffers.kv):
            assert np.array_equal(ours.host[:, :, :length], theirs.host[:, :, :length])


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_tokens_match_the_whole_prompt_and_the_numpy_reference(base, whole, padded,
                                                                      length):
    prompt = _prompt(length, seed=length)
    tokens = padded.open_sequence().generate(prompt, 6)
    assert tokens == whole.open_sequence().generate(prompt, 6)
    assert tokens == ReferenceDecoder.from_model_dir(base).greedy(prompt, 6)


def test_chunks_run_at_the_chunk_width_and_the_remainder_pads_up_the_ladder(chunked, padded):
    prompt = _prompt(2 * W + 5)
    unpadded = chunked.open_sequence()
    unpadded.generate(prompt, 2)
    assert [(c.rows, c.width) for c in unpadded.stats.last_generation.chunks] == [
        (W, W), (W, W), (5, 5)]
    sequence = padded.open_sequence()
    sequence.generate(prompt, 2)
    tier = min(t for t in padded.stats.ladder if t >= 5)
    assert [(c.rows, c.width) for c in sequence.stats.last_generation.chunks] == [
        (W, W), (W, W), (5, tier)]
    assert sequence.stats.padded_rows == tier - 5
    assert sequence.length == 2 * W + 5 + 1


def test_kv_buffers_are_allocated_once_at_capacity_and_written_in_place(padded):
    sequence = padded.open_sequence()
    buffers = sequence.buffers.kv
    pointers = [buffer.value.data_ptr() for buffer in buffers]
    assert all(buffer.host.shape[2] == CAPACITY for buffer in buffers)
    # A pooled buffer set may hold an earlier sequence's entries past the length (masked).
    reach = 2 * W + max(padded.stats.ladder)
    beyond = [buffer.host[:, :, reach:].copy() for buffer in buffers]
    sequence.generate(_prompt(40), 5)
    assert sequence.buffers.kv is buffers
    assert [buffer.value.data_ptr() for buffer in buffers] == pointers
    for buffer, before in zip(buffers, beyond):
        assert np.abs(buffer.host[:, :, :sequence.length]).sum() > 0
        # Padded rows may have written just past the length; nothing beyond the chunk reach.
        assert np.array_equal(buffer.host[:, :, reach:], before)


def test_capacity_wide_mask_gives_identical_logits(base, whole, chunked):
    wide = _load(base, chunk_size=W, padding=False, mask_policy="capacity")
    prompt = _prompt(2 * W + 3)
    sequence = wide.open_sequence()
    assert np.array_equal(sequence.prefill(prompt, all_logits=True),
                          whole.open_sequence().prefill(prompt, all_logits=True))
    logical = chunked.open_sequence()
    logical.prefill(prompt)
    for token in (7, 8, 9):
        assert np.array_equal(sequence.decode(token), logical.decode(token))
    assert sequence.buffers.kv[0].host.shape == logical.buffers.kv[0].host.shape


def test_a_one_row_remainder_borrows_a_row():
    assert prefill_chunks(17, 16) == [(0, 15), (15, 17)]
    assert prefill_chunks(33, 16) == [(0, 16), (16, 31), (31, 33)]
    assert prefill_chunks(1, 16) == [(0, 1)]
    assert prefill_chunks(16, 16) == [(0, 16)]
    assert prefill_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    for length in range(1, 60):
        bounds = prefill_chunks(length, 8)
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(1 <= end - begin <= 8 for begin, end in bounds)
        assert len(bounds) == 1 or bounds[-1][1] - bounds[-1][0] >= 2


def _extend(runtime, prompt, token):
    return runtime.open_sequence().prefill(prompt + [token])


def test_decode_continues_the_prefill(whole, padded):
    prompt = _prompt(W + 3)
    sequence = padded.open_sequence()
    sequence.prefill(prompt)
    logits = sequence.decode(11)
    assert logits.shape == (256,)
    np.testing.assert_allclose(logits, _extend(whole, prompt, 11), rtol=1e-5, atol=1e-5)


def test_rewind_then_refeed_gives_the_same_logits(padded):
    prompt = _prompt(2 * W + 9)
    sequence = padded.open_sequence()
    last = sequence.prefill(prompt)
    sequence.rewind(W + 2)
    assert sequence.length == len(prompt) - W - 2
    again = sequence.prefill(prompt[-(W + 2):])
    assert np.array_equal(again, last)
    first = padded.open_sequence().generate([3, 4, 5], 4)
    sequence.rewind(sequence.length)
    assert sequence.generate([3, 4, 5], 4) == first


def test_generate_stops_after_eos_and_stream_yields_as_it_goes(padded):
    prompt = _prompt(20)
    tokens = padded.open_sequence().generate(prompt, 8)
    eos = tokens[2]
    stop = tokens.index(eos)
    sequence = padded.open_sequence()
    assert sequence.generate(prompt, 8, eos_token_id=eos) == tokens[:stop + 1]
    assert sequence.stats.last_generation.stopped_by_eos
    streamed = padded.open_sequence()
    stream = streamed.stream(prompt, 8)
    assert streamed.length == 0
    assert next(stream) == tokens[0]
    assert streamed.length == len(prompt)
    assert streamed.stats.last_generation.ttft_s > 0
    assert list(stream) == tokens[1:]
    stats = streamed.stats.last_generation
    assert stats.new_tokens == 8 and stats.decode_tokens_per_s > 0


def test_variant_cache_holds_the_ladder_and_stops_compiling(base):
    runtime = _load(base, chunk_size=W)
    lengths = [5, 23, 40, 7, 61]
    for _ in range(2):
        for length in lengths:
            runtime.open_sequence().generate(_prompt(length), 2)
        if _ == 0:
            compiles = runtime.stats.cache.compiles
    cache = runtime.stats.cache
    assert cache.compiles == compiles
    assert set(cache.widths) <= {1, *runtime.stats.ladder}
    assert cache.variants <= cache.cap and cache.evictions == 0
    assert runtime.stats.sessions_created == cache.compiles


def test_converted_model_declares_its_chunk_width(base, tmp_path, whole):
    model = load_model(base)
    convert_model(model, chunk_size=24)
    target = tmp_path / "model.onnx"
    save_model(model, target)
    runtime = load(target, provider="cpu")
    assert runtime.stats.chunk_size == 24
    assert runtime.stats.ladder == runtime.debug.plan.ladder
    assert runtime.stats.capacity == runtime.debug.plan.max_sequence_length
    prompt = _prompt(60)
    assert runtime.open_sequence().generate(prompt, 4) == whole.open_sequence().generate(prompt, 4)


def test_padding_switches(base, monkeypatch):
    assert _load(base, chunk_size=W).stats.padding != "off"
    for variable in ("ONNX_CHUNK_PREFILL_QUERY_PADDING", "ONNX_GENAI_PREFILL_QUERY_PADDING"):
        monkeypatch.setenv(variable, "0")
        runtime = _load(base, chunk_size=W)
        assert runtime.stats.padding == "off"
        assert variable in runtime.stats.cache.padding_refused
        monkeypatch.delenv(variable)
    refused = _load(base, chunk_size=W, padding=False)
    assert refused.stats.padding == "off" and refused.stats.cache.padding_refused


def test_a_small_cache_evicts_and_results_stay_exact(base, whole):
    runtime = _load(base, chunk_size=W, padding=False, max_variants=2)
    sequence = runtime.open_sequence()
    for length in (5, 40, 23):
        prompt = _prompt(length, seed=length)
        sequence.rewind(sequence.length)
        assert sequence.generate(prompt, 3) == whole.open_sequence().generate(prompt, 3)
    cache = runtime.stats.cache
    assert cache.evictions > 0 and cache.variants <= 2 and cache.peak_variants <= 2


def test_evicted_sessions_are_freed_and_exact_keys_thrash(reference_model, monkeypatch):
    """The naive per-shape cache ("exact") keeps building under a small cap; every evicted
    session is released for real: no sequence's bindings keep it alive."""
    import gc
    import weakref

    from onnx_chunk import load

    runtime = load(reference_model("base"), provider="cpu", chunk_size=16, max_variants=2,
                   padding=False, specialize="exact")
    built = []
    factory = runtime.debug.factory
    create = factory.create

    def tracking_create(*args, **kwargs):
        session = create(*args, **kwargs)
        built.append(weakref.ref(session))
        return session

    monkeypatch.setattr(factory, "create", tracking_create)
    sequence = runtime.open_sequence()
    for length in (5, 7, 9, 5, 7, 9):
        sequence.generate(list(range(1, length + 1)), max_new_tokens=2)
        sequence.rewind(sequence.length)
    stats = runtime.stats.cache
    assert stats.variants <= 2
    assert stats.evictions == stats.compiles - stats.variants > 0
    gc.collect()
    alive = sum(ref() is not None for ref in built)
    assert alive == stats.variants
