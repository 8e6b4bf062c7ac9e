"""Every reference decoder variant runs chunked and matches its whole-prompt forward."""

import numpy as np
import pytest

from onnx_chunk.errors import InputError, ModelStructureError
from onnx_chunk.models.reference import ReferenceDecoder
from onnx_chunk.runtime import load

W = 16
PROMPT = np.random.default_rng(3).integers(0, 256, 2 * W + 11).tolist()


def _generation(runtime):
    sequence = runtime.open_sequence()
    sequence.generate(PROMPT, 1)
    return sequence.stats.last_generation


def _pair(path):
    chunked = load(path, provider="cpu", capacity=128, chunk_size=W, specialize=True)
    whole = load(path, provider="cpu", capacity=128, chunk_size=128, padding=False)
    return chunked, whole


@pytest.mark.parametrize("variant", ["base", "int4", "position_ids", "inputs_embeds"])
def test_variant_padded_and_unpadded_logits_and_kv_equal_the_whole_prompt(reference_model,
                                                                          variant):
    path = reference_model(variant)
    chunked, whole = _pair(path)
    unpadded = load(path, provider="cpu", capacity=128, chunk_size=W, specialize=True,
                    padding=False)
    assert chunked.stats.padding != "off" and unpadded.stats.padding == "off"
    reference = whole.open_sequence()
    expected = reference.prefill(PROMPT, all_logits=True)
    for runtime in (chunked, unpadded):
        sequence = runtime.open_sequence()
        assert np.array_equal(sequence.prefill(PROMPT, all_logits=True), expected)
        for ours, theirs in zip(sequence.buffers.kv, reference.buffers.kv):
            assert np.array_equal(ours.host[:, :, :len(PROMPT)], theirs.host[:, :, :len(PROMPT)])
    padded_widths = [c.width for c in _generation(chunked).chunks]
    assert padded_widths[-1] != len(PROMPT) % W  # the remainder really was padded


@pytest.mark.parametrize("variant", ["int4", "position_ids", "inputs_embeds"])
def test_variant_chunked_greedy_tokens(reference_model, variant):
    path = reference_model(variant)
    chunked, whole = _pair(path)
    tokens = chunked.open_sequence().generate(PROMPT, 5)
    assert tokens == whole.open_sequence().generate(PROMPT, 5)
    if variant != "int4":
        assert tokens == ReferenceDecoder.from_model_dir(path).greedy(PROMPT, 5)


def test_conv_state_is_carried_across_chunks_in_ping_pong_buffers(reference_model):
    path = reference_model("conv_hybrid")
    chunked, whole = _pair(path)
    assert chunked.debug.ports.state and chunked.stats.padding == "off"
    assert "refused by the model" in chunked.stats.cache.padding_refused
    sequence = chunked.open_sequence()
    tokens = sequence.generate(PROMPT, 6)
    assert tokens == whole.open_sequence().generate(PROMPT, 6)
    assert tokens == ReferenceDecoder.from_model_dir(path).greedy(PROMPT, 6)
    assert [(c.rows, c.width) for c in sequence.stats.last_generation.chunks] == [
        (W, W), (W, W), (11, 11)]
    current = sequence.buffers.state(0)
    sequence.decode(5)
    after_one = sequence.buffers.state(0)
    sequence.decode(6)
    assert after_one is not current and sequence.buffers.state(0) is current
    assert np.abs(current.host).sum() > 0


def test_conv_state_cannot_rewind_partway(reference_model):
    chunked, _ = _pair(reference_model("conv_hybrid"))
    sequence = chunked.open_sequence()
    first = sequence.generate(PROMPT, 3)
    with pytest.raises(InputError, match="recurrent state"):
        sequence.rewind(2)
    sequence.rewind(sequence.length)
    assert not sequence.buffers.state(0).host.any()
    assert sequence.generate(PROMPT, 3) == first


def test_last_token_logits_switches_padding_off_and_reruns(reference_model, caplog):
    chunked, whole = _pair(reference_model("last_token_logits"))
    assert chunked.stats.padding != "off"
    sequence = chunked.open_sequence()
    tokens = sequence.generate(PROMPT, 5)
    assert chunked.stats.padding == "off"
    assert "shrinks the query axis" in chunked.stats.cache.padding_refused
    assert tokens == whole.open_sequence().generate(PROMPT, 5)
    assert sequence.stats.padded_rows == 0
    with pytest.raises(ModelStructureError, match="last row"):
        chunked.open_sequence().prefill(PROMPT, all_logits=True)


def test_unknown_request_input_is_refused_at_load(reference_model):
    with pytest.raises(ModelStructureError, match="row_scale"):
        load(reference_model("odd_port"), provider="cpu", capacity=128)
