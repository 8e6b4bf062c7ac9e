"""GQA's shared-buffer mode: past and present bound to one capacity-sized OrtValue."""

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.models.reference import ReferenceDecoder

from ._ort import carry, empty_state_feeds, request_feeds, run, session

CAPACITY = 32
CHUNKS = (4, 4, 3)


def _grow_as_you_go(sess, ref, prompt, steps):
    state_feeds, past, logits, token_rows = empty_state_feeds(ref), 0, [], []
    ids_list = [prompt[:, :4], prompt[:, 4:8], prompt[:, 8:]]
    for step in range(len(ids_list) + steps):
        ids = ids_list[step] if step < len(ids_list) else token_rows[-1]
        outputs = run(sess, {**request_feeds(ref, ids, past)[0], **state_feeds})
        logits.append(outputs["logits"])
        token_rows.append(np.array([[int(np.argmax(outputs["logits"][0, -1]))]]))
        state_feeds, past = carry(outputs), past + ids.shape[1]
    return logits


def _shared(sess, ref, prompt, steps, full_width_mask):
    c = ref.config
    binding = sess.io_binding()
    binding.bind_output("logits")  # first, so it is output 0 of copy_outputs_to_cpu
    buffers = {}
    for layer in c.attention_layers:
        for kind in ("key", "value"):
            buffer = ort.OrtValue.ortvalue_from_numpy(
                np.zeros((1, c.num_kv_heads, CAPACITY, c.head_size), np.float32))
            buffers[layer, kind] = buffer
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", buffer)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", buffer)
    ids_list = [prompt[:, :4], prompt[:, 4:8], prompt[:, 8:]]
    past, logits = 0, []
    for step in range(len(ids_list) + steps):
        ids = ids_list[step] if step < len(ids_list) else np.array(
            [[int(np.argmax(logits[-1][0, -1]))]])
        rows = ids.shape[1]
        if full_width_mask:
            mask = np.zeros((1, CAPACITY), np.int64)
            mask[0, :past + rows] = 1
        else:
            mask = np.ones((1, past + rows), np.int64)
        binding.bind_cpu_input("input_ids", ids.astype(np.int64))
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_output("logits")
        sess.run_with_iobinding(binding)
        logits.append(binding.copy_outputs_to_cpu()[0])
        past += rows
    return logits, buffers, past


@pytest.mark.parametrize("full_width_mask", [False, True], ids=["logical-mask", "capacity-mask"])
def test_shared_capacity_buffer_equals_grow_as_you_go(reference_model, full_width_mask):
    path = reference_model("base")
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    prompt = np.random.default_rng(3).integers(0, 256, size=(1, sum(CHUNKS)))
    expected = _grow_as_you_go(sess, ref, prompt, steps=4)
    got, buffers, length = _shared(sess, ref, prompt, steps=4, full_width_mask=full_width_mask)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=0)
    _, state = ref.forward(np.concatenate([prompt] + [np.array([[int(np.argmax(e[0, -1]))]])
                                                      for e in expected[2:-1]], axis=1))
    key = buffers[1, "key"].numpy()
    np.testing.assert_allclose(key[:, :, :length], state.keys[1], atol=1e-4, rtol=0)
    assert not key[:, :, length:].any()
