"""A generation that fails partway leaves its sequence as it was; one stopped early keeps
what it generated."""

import onnxruntime as ort
import pytest

from onnx_chunk.runtime import load


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_a_generation_failing_in_decode_leaves_the_sequence_as_it_was(reference_model,
                                                                      monkeypatch, variant):
    runtime = load(reference_model(variant), provider="cpu", capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    sequence.prefill(list(range(3, 12)))
    state_before = [bytes(array.tobytes()) for array in sequence.buffers.snapshot_state()]
    expected = runtime.open_sequence()
    expected.prefill(list(range(3, 12)))
    runs = []
    original = ort.InferenceSession.run_with_iobinding

    def failing(self, iobinding, run_options=None):
        # The prompt's two chunks (30 tokens at W 16), then the third decode step fails.
        runs.append(iobinding)
        if len(runs) == 2 + 3:
            raise RuntimeError("device lost")
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        sequence.generate(list(range(20, 50)), 6)
    monkeypatch.undo()
    assert sequence.length == 9
    assert [bytes(a.tobytes()) for a in sequence.buffers.snapshot_state()] == state_before
    assert sequence.generate([7, 8], 4) == expected.generate([7, 8], 4)


def test_a_stream_stopped_early_keeps_what_it_generated(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    stream = sequence.stream(list(range(3, 23)), 8)
    taken = [next(stream) for _ in range(3)]
    stream.close()
    assert len(taken) == 3 and sequence.length == 20 + 2


def test_stats_are_a_snapshot_that_later_steps_do_not_change(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    stream = sequence.stream(list(range(3, 23)), 6)
    next(stream)
    early = sequence.stats
    list(stream)
    assert early.last_generation.new_tokens == 1 and early.length == 20
    assert sequence.stats.last_generation.new_tokens == 6
