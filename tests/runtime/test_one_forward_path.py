"""One forward path: every forward of a dynamic decoder (a lone sequence's, the engine's prefill
chunks and its batched decode) goes through the one model runner and `Device.run`; one finish
rule; `stats` a property everywhere, the old call kept through a deprecation."""

import inspect
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnx_chunk
from onnx_chunk.runtime import Request, RequestStats, RuntimeStats, SequenceStats, load
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.request import finish_reason
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot
from onnx_chunk.runtime.runner.model_runner import Forward, ModelRunner, Row

PACKAGE = Path(onnx_chunk.__file__).parent
RUNNER = "onnx_chunk.runtime.runner.model_runner"


def _sources() -> dict[str, str]:
    """Every module of the package but the static runner (its own path, moving separately)."""
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")
            if path.relative_to(PACKAGE).parts[0] != "static"}


def test_one_module_calls_onnx_runtimes_run():
    sources = _sources()
    assert [name for name, text in sources.items()
            if "run_with_iobinding(" in text] == ["runtime/device/provider.py"]
    # The runner's forwards, and the device's one-node probe of how a buffer is bound.
    assert sorted(name for name, text in sources.items() if "device.run(" in text) == [
        "runtime/device/identity.py", "runtime/runner/model_runner.py"]
    assert not [name for name, text in sources.items() if "session.run(" in text]


@pytest.fixture
def recorded(monkeypatch):
    """Every ORT run, every `Device.run` with its calling module, every runner forward's rows."""
    seen = {"ort": 0, "device": [], "forwards": []}
    run_with_iobinding = ort.InferenceSession.run_with_iobinding
    device_run = Device.run
    runner_run = ModelRunner.run

    def ort_run(self, *args, **kwargs):
        seen["ort"] += 1
        return run_with_iobinding(self, *args, **kwargs)

    def plain_run(self, *args, **kwargs):
        raise AssertionError("a dynamic forward ran outside IOBinding")

    def recording_device_run(self, session, binding, options, then=None):
        seen["device"].append(inspect.currentframe().f_back.f_globals["__name__"])
        return device_run(self, session, binding, options, then)

    def recording_runner_run(self, slot, forward):
        seen["forwards"].append((len(forward.rows), forward.width))
        return runner_run(self, slot, forward)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", ort_run)
    monkeypatch.setattr(ort.InferenceSession, "run", plain_run)
    monkeypatch.setattr(Device, "run", recording_device_run)
    monkeypatch.setattr(ModelRunner, "run", recording_runner_run)
    return seen


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_a_sequence_and_the_engine_run_through_the_one_runner(reference_model, recorded,
                                                               variant):
    runtime = load(reference_model(variant), provider="cpu", capacity=96, chunk_size=16,
                   max_batch=2)
    prompts = [list(range(3, 40)), list(range(5, 12))]
    alone = [runtime.open_sequence().generate(prompt, 5, []) for prompt in prompts]
    assert runtime.generate_many(prompts, 5, eos_token_id=[]) == alone
    # Every ORT run went through Device.run, called by the runner alone.
    assert recorded["ort"] == len(recorded["device"]) > 0
    assert set(recorded["device"]) == {RUNNER}
    # The engine's decode was a runner forward of both batch rows; prefill chunks one row.
    assert (2, 1) in recorded["forwards"]
    assert {(1, 16), (1, 7)} <= set(recorded["forwards"])


def test_a_batched_forward_of_several_tokens_per_row_is_refused(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    debug = runtime.debug
    buffers = BatchBuffers(debug.ports.kv, debug.ports.state, debug.device, 2)
    batch = SequenceSlot(debug.pool.take_number(), buffers,
                         debug.masks(2, 96, debug.ports.mask_dtype, debug.device))
    rows = [Row(np.array([1, 2]), LogicalLength(96)), Row(np.array([3, 4]), LogicalLength(96))]
    with pytest.raises(ValueError, match="one token per row"):
        runtime.debug.runner.run(batch, Forward(rows))
    with pytest.raises(ValueError, match="2 batch rows"):
        runtime.debug.runner.run(batch, Forward(rows[:1]))


def test_finish_rule():
    assert finish_reason(7, 1, 4, (7,)) == "stop"
    assert finish_reason(7, 4, 4, (7,)) == "stop"  # an EOS as the last allowed token
    assert finish_reason(5, 4, 4, (7,)) == "length"
    assert finish_reason(5, 3, 4, (7,)) is None
    assert finish_reason(5, 3, 4, ()) is None


def test_a_sequence_stops_where_a_request_stops(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    prompt = list(range(3, 30))
    free = runtime.open_sequence().generate(prompt, 8, [])
    stop = free[3]
    sequence = runtime.open_sequence()
    request = runtime.submit(prompt, 8, eos_token_id=stop)
    assert sequence.generate(prompt, 8, stop) == request.result() == free[:free.index(stop) + 1]
    assert request.finish_reason == "stop" and sequence.stats.last_generation.stopped_by_eos


def test_stats_are_properties_and_the_old_call_warns(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    request: Request = runtime.submit([1, 2, 3], 2, eos_token_id=[])
    request.result()
    assert isinstance(runtime.stats, RuntimeStats)
    assert isinstance(sequence.stats, SequenceStats)
    assert isinstance(request.stats, RequestStats)
    assert runtime.stats.capacity == runtime.debug.options.capacity == 96
    with pytest.warns(DeprecationWarning, match="runtime.stats"):
        called = runtime.stats()
    assert isinstance(called, RuntimeStats) and called.engine.completed == 1
