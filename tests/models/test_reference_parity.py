"""Every variant in ORT's CPU provider agrees with the NumPy reference, prompt and decode."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_chunk.models import VARIANTS
from onnx_chunk.models.reference import DecoderState, ReferenceDecoder

from ._ort import carry, empty_state_feeds, request_feeds, run, session

# Documented in docs/models.md: ORT float32 vs the float64 reference, logits of magnitude ~10.
ATOL = 1e-4


def _positions(past: int, rows: int) -> np.ndarray:
    # Not past + arange: rotary is shift-invariant, so a stretched ramp proves the input is used.
    return (3 + 2 * np.arange(past, past + rows, dtype=np.int64))[None]


def _row_scale(past: int, rows: int) -> np.ndarray:
    return np.linspace(0.5, 1.5, rows).astype(np.float32) + np.float32(past % 3) * 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_and_decode_steps_match_the_reference(reference_model, variant):
    path = reference_model(variant)
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, ref.config.vocab_size, size=(1, 9))
    state_feeds, state, past = empty_state_feeds(ref), None, 0
    for _ in range(5):
        rows = ids.shape[1]
        feeds, kwargs = request_feeds(ref, ids, past, _positions(past, rows),
                                      _row_scale(past, rows))
        outputs = run(sess, {**feeds, **state_feeds})
        expected, state = ref.forward(state=state, **kwargs)
        assert outputs["logits"].shape == expected.shape
        expected_rows = 1 if variant == "last_token_logits" else rows
        assert expected.shape == (1, expected_rows, ref.config.vocab_size)
        np.testing.assert_allclose(outputs["logits"], expected, atol=ATOL, rtol=0)
        for layer in ref.config.attention_layers:
            np.testing.assert_allclose(outputs[f"present.{layer}.key"], state.keys[layer],
                                       atol=ATOL, rtol=0)
            np.testing.assert_allclose(outputs[f"present.{layer}.value"], state.values[layer],
                                       atol=ATOL, rtol=0)
            assert state.values[layer].shape[2] == past + rows
        for layer in ref.config.conv_layers:
            np.testing.assert_allclose(outputs[f"present.{layer}.conv"], state.conv[layer],
                                       atol=ATOL, rtol=0)
        state_feeds = carry(outputs)
        past += rows
        ids = np.array([[int(np.argmax(outputs["logits"][0, -1]))]], dtype=np.int64)
    assert state.length == 9 + 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_rotary_tables_equal_the_files_caches(reference_model, variant):
    path = reference_model(variant)
    ref = ReferenceDecoder.from_model_dir(path.parent)
    model = onnx.load(str(path), load_external_data=True)
    caches = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
              if i.name in ("cos_cache", "sin_cache")}
    assert ref.cos.shape == ref.sin.shape == (2048, 8)
    assert ref.cos.dtype == np.float64
    np.testing.assert_allclose(caches["cos_cache"], ref.cos, atol=1e-7, rtol=0)
    np.testing.assert_allclose(caches["sin_cache"], ref.sin, atol=1e-7, rtol=0)
    # Position 1, frequency 0 is one radian; the last frequency is theta^(-(d-2)/d).
    assert ref.sin[1, 0] == pytest.approx(np.sin(1.0))
    assert ref.cos[1, -1] == pytest.approx(np.cos(10000.0 ** (-14 / 16)))


def test_a_wrong_rotary_table_in_the_file_is_caught(reference_model, tmp_path):
    path = reference_model("base")
    ref = ReferenceDecoder.from_model_dir(path.parent)
    model = onnx.load(str(path), load_external_data=True)
    for init in model.graph.initializer:
        if init.name in ("cos_cache", "sin_cache"):
            table = numpy_helper.to_array(init)
            # The tables of rope_theta 500000 instead of 10000: a plausible builder mistake.
            angles = np.arange(table.shape[0])[:, None] * 500000.0 ** (
                -np.arange(table.shape[1]) * 2.0 / (2 * table.shape[1]))
            wrong = np.cos(angles) if init.name == "cos_cache" else np.sin(angles)
            init.CopyFrom(numpy_helper.from_array(wrong.astype(np.float32), init.name))
    mutated = tmp_path / "model.onnx"
    onnx.save(model, str(mutated))
    ids = np.random.default_rng(3).integers(0, ref.config.vocab_size, size=(1, 12))
    outputs = run(session(mutated), {**request_feeds(ref, ids, 0)[0], **empty_state_feeds(ref)})
    expected, _ = ref.forward(ids)
    assert np.abs(outputs["logits"] - expected).max() > 10 * ATOL


def test_int4_reference_differs_from_fp32_by_quantization_only(reference_model):
    fp32 = ReferenceDecoder.from_model_dir(reference_model("base"))
    int4 = ReferenceDecoder.from_model_dir(reference_model("int4"))
    ids = np.arange(10, 30).reshape(1, -1)
    difference = np.abs(fp32.forward(ids)[0] - int4.forward(ids)[0])
    assert 1e-3 < difference.max() < 0.5 * np.abs(fp32.forward(ids)[0]).max()


def test_conv_state_carried_in_chunks_equals_one_whole_forward(reference_model):
    path = reference_model("conv_hybrid")
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    prompt = np.random.default_rng(9).integers(0, 256, size=(1, 12))
    whole = run(sess, {**request_feeds(ref, prompt, 0)[0], **empty_state_feeds(ref)})
    state_feeds, past, chunks = empty_state_feeds(ref), 0, []
    for chunk in (prompt[:, :5], prompt[:, 5:6], prompt[:, 6:]):
        outputs = run(sess, {**request_feeds(ref, chunk, past)[0], **state_feeds})
        chunks.append(outputs["logits"])
        state_feeds, past = carry(outputs), past + chunk.shape[1]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), whole["logits"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(state_feeds["past.0.conv"], whole["present.0.conv"], atol=1e-6,
                               rtol=0)
    assert state_feeds["past.0.conv"].shape == (1, 64, ref.config.conv_kernel - 1)


def test_odd_port_really_changes_the_output(reference_model):
    path = reference_model("odd_port")
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    ids = np.arange(1, 7).reshape(1, -1)
    ones, _ = request_feeds(ref, ids, 0, row_scale=np.ones(6, np.float32))
    halves, _ = request_feeds(ref, ids, 0, row_scale=np.full(6, 0.5, np.float32))
    assert [i.shape for i in sess.get_inputs() if i.name == "row_scale"] == [["sequence_length"]]
    first = run(sess, {**ones, **empty_state_feeds(ref)})["logits"]
    second = run(sess, {**halves, **empty_state_feeds(ref)})["logits"]
    assert np.abs(first - second).max() > 1e-2


def test_position_ids_drive_rotary(reference_model):
    path = reference_model("position_ids")
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    ids = np.arange(1, 7).reshape(1, -1)
    results = []
    for positions in (np.arange(6)[None], 2 * np.arange(6)[None]):
        feeds, _ = request_feeds(ref, ids, 0, positions=positions.astype(np.int64))
        results.append(run(sess, {**feeds, **empty_state_feeds(ref)})["logits"])
    assert np.abs(results[0] - results[1]).max() > 1e-2
    base = ReferenceDecoder.from_model_dir(reference_model("base"))
    np.testing.assert_allclose(results[0], base.forward(ids)[0], atol=ATOL, rtol=0)


def test_reference_state_starts_empty():
    from onnx_chunk.models import config_for

    state = DecoderState.empty(config_for("tiny", conv_layers=(0,)), batch=2)
    assert state.length == 0
    assert list(state.keys) == [1] and state.conv[0].shape == (2, 64, 2)
