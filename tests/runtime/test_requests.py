"""Bad requests fail clearly before any work and leave the sequence usable; threads agree."""

import json
import threading

import numpy as np
import pytest

from onnx_chunk.errors import CapacityError, ClosedError, ConfigError, InputError, SequenceBusyError
from onnx_chunk.runtime import load
from tests.validate.mutations import copy_model

W = 16


@pytest.fixture(scope="module")
def runtime(reference_model):
    return load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([1, 256], "token id 256 at position 1 is outside the vocabulary"),
    ([-1, 3], "token id -1 at position 0"),
    ([1.0, 2.0], "must be integers"),
    ([True, False], "must be integers"),
    ([[1, 2]], "1-D"),
])
def test_bad_prompts(runtime, prompt, message):
    sequence = runtime.open_sequence()
    sequence.prefill([1, 2, 3])
    with pytest.raises(InputError, match=message):
        sequence.generate(prompt, 2)
    with pytest.raises(InputError, match=message):
        sequence.prefill(prompt)
    assert sequence.length == 3


def test_capacity_is_checked_before_any_work_with_the_numbers(runtime):
    sequence = runtime.open_sequence()
    prompt = list(range(1, 31))
    sequence.prefill(prompt)
    kv_before = [buffer.host.copy() for buffer in sequence.buffers.kv]
    with pytest.raises(CapacityError, match=r"30 tokens plus 10 new tokens needs 40 positions .*"
                                            r"holds 30 of its 64-position .*34 left"):
        sequence.stream(list(range(30)), 10)
    with pytest.raises(CapacityError):
        sequence.prefill(list(range(35)))
    assert sequence.length == 30
    assert all(np.array_equal(a, b.host) for a, b in zip(kv_before, sequence.buffers.kv))
    fresh = runtime.open_sequence()
    fresh.prefill(prompt)
    assert sequence.generate([5, 6], 4) == fresh.generate([5, 6], 4)


def test_decode_at_capacity_and_bad_counts(runtime):
    sequence = runtime.open_sequence()
    sequence.prefill(list(range(1, 65)))
    with pytest.raises(CapacityError, match="decode step"):
        sequence.decode(3)
    with pytest.raises(InputError, match="at least 1"):
        runtime.open_sequence().generate([1], 0)
    with pytest.raises(InputError, match="integer"):
        runtime.open_sequence().generate([1], 2.5)
    with pytest.raises(InputError):
        sequence.decode(999)
    assert sequence.length == 64


def test_a_failing_forward_leaves_the_sequence_as_it_was(runtime, monkeypatch):
    sequence = runtime.open_sequence()
    sequence.prefill([4, 5, 6])
    expected = runtime.open_sequence()
    expected.prefill([4, 5, 6])
    calls = []
    original = runtime.debug.runner.run

    def failing(slot, forward):
        calls.append(forward.width)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return original(slot, forward)

    monkeypatch.setattr(runtime.debug.runner, "run", failing)
    with pytest.raises(RuntimeError):
        sequence.prefill(list(range(1, 40)))
    monkeypatch.undo()
    assert calls[0] == W and sequence.length == 3
    assert sequence.generate([9, 10], 3) == expected.generate([9, 10], 3)


def generate_in_threads(runtime, prompts, rounds, new_tokens):
    """Each prompt generated `rounds` times in a thread of its own, all threads at once."""
    results: dict[int, list[list[int]]] = {index: [] for index in range(len(prompts))}
    errors = []

    def drive(index):
        try:
            for _ in range(rounds):
                results[index].append(runtime.open_sequence().generate(prompts[index],
                                                                       new_tokens))
        except Exception as error:  # collected and asserted on by the caller
            errors.append(error)

    threads = [threading.Thread(target=drive, args=(index,)) for index in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_two_sequences_in_two_threads_match_each_alone(runtime):
    prompts = [list(range(1, 40)), list(range(200, 221))]
    alone = [runtime.open_sequence().generate(prompt, 6) for prompt in prompts]
    results, errors = generate_in_threads(runtime, prompts, rounds=4, new_tokens=6)
    assert not errors
    assert results[0] == [alone[0]] * 4 and results[1] == [alone[1]] * 4


def test_load_errors(reference_model, tmp_path):
    path = reference_model("base")
    with pytest.raises(ConfigError, match="exceeds the model's maximum sequence length 2048"):
        load(path, provider="cpu", capacity=4096)
    with pytest.raises(ConfigError, match="chunk size"):
        load(path, provider="cpu", capacity=64, chunk_size=0)
    from onnx_chunk.errors import ModelLoadError
    with pytest.raises(ModelLoadError):
        load(tmp_path / "missing.onnx", provider="cpu")


def _paused_before_prefill(runtime, monkeypatch):
    """Make the runtime's next forward (`ModelRunner.run`: a prefill chunk) wait for `proceed`
    once it has `started`."""
    started, proceed = threading.Event(), threading.Event()
    run = runtime.debug.runner.run

    def paused(slot, forward):
        if not started.is_set():
            started.set()
            assert proceed.wait(60)
        return run(slot, forward)

    monkeypatch.setattr(runtime.debug.runner, "run", paused)
    return started, proceed


def test_a_second_call_on_a_busy_sequence_is_refused_and_the_first_stays_right(runtime,
                                                                             monkeypatch):
    prompt = list(range(1, 40))
    alone = runtime.open_sequence().generate(prompt, 6)
    sequence = runtime.open_sequence()
    started, proceed = _paused_before_prefill(runtime, monkeypatch)
    results = []
    first = threading.Thread(target=lambda: results.append(sequence.generate(prompt, 6)))
    first.start()
    try:
        assert started.wait(60)
        for call in (lambda: sequence.generate([5, 6, 7], 6), lambda: sequence.stream([5], 2),
                     lambda: sequence.prefill([5, 6]), lambda: sequence.decode(5),
                     lambda: sequence.rewind(0)):
            with pytest.raises(SequenceBusyError, match="busy"):
                call()
    finally:
        proceed.set()
        first.join()
    assert results == [alone]


def test_two_streams_of_one_sequence_cannot_interleave(runtime):
    prompt = list(range(1, 40))
    alone = runtime.open_sequence().generate(prompt, 6)
    sequence = runtime.open_sequence()
    stream = sequence.stream(prompt, 6)
    tokens = [next(stream)]
    with pytest.raises(SequenceBusyError):
        sequence.stream([100, 101], 2)
    with pytest.raises(SequenceBusyError):
        sequence.generate([100, 101], 2)
    tokens += list(stream)
    assert tokens == alone
    sequence.rewind(sequence.length)
    assert sequence.generate(prompt, 6) == alone


@pytest.mark.parametrize("abandon", ["closed", "collected unstarted", "collected started"])
def test_an_abandoned_stream_frees_its_sequence(runtime, abandon):
    import gc

    prompt = list(range(1, 40))
    alone = runtime.open_sequence().generate(prompt, 6)
    sequence = runtime.open_sequence()
    stream = sequence.stream(prompt, 6)
    if abandon != "collected unstarted":
        next(stream)
    if abandon == "closed":
        stream.close()
    del stream
    gc.collect()
    sequence.rewind(sequence.length)
    assert sequence.generate(prompt, 6) == alone


@pytest.mark.parametrize("count", [2.5, True, "1", None, -1, 4])
def test_rewind_takes_an_integer_within_the_length(runtime, count):
    sequence = runtime.open_sequence()
    sequence.prefill([1, 2, 3])
    with pytest.raises(InputError, match="rewind count"):
        sequence.rewind(count)
    assert sequence.length == 3
    sequence.rewind(np.int64(1))
    assert sequence.length == 2 and type(sequence.length) is int


@pytest.mark.parametrize("options", [
    {"capacity": 2.5}, {"capacity": True}, {"capacity": "64"},
    {"chunk_size": 2.0}, {"chunk_size": "64"}, {"chunk_size": False},
    {"max_variants": 1.5}, {"device_id": -1}, {"padding": "yes"},
])
def test_load_refuses_options_of_the_wrong_type(reference_model, options):
    with pytest.raises(ConfigError, match="must be"):
        load(reference_model("base"), provider="cpu", **{"capacity": 64, **options})


def test_load_takes_numpy_integers(reference_model):
    loaded = load(reference_model("base"), provider="cpu", capacity=np.int64(64),
                  chunk_size=np.int32(16))
    assert loaded.stats.capacity == 64 and loaded.stats.chunk_size == 16


@pytest.mark.parametrize("eos", [-1, 256, "2", 1e30, 2.0, True, [1, -1], ["2"]])
def test_generate_refuses_eos_ids_that_can_never_stop_it(runtime, eos):
    sequence = runtime.open_sequence()
    with pytest.raises(InputError, match="eos_token_id"):
        sequence.generate([1, 2, 3], 4, eos)
    with pytest.raises(InputError, match="eos_token_id"):
        sequence.stream([1, 2, 3], 4, eos)
    assert sequence.length == 0


def test_generate_stops_at_any_of_several_eos_ids(runtime):
    prompt = list(range(1, 40))
    free = runtime.open_sequence().generate(prompt, 8)
    stop_at = free[3]
    first = free.index(stop_at) + 1
    sequence = runtime.open_sequence()
    assert sequence.generate(prompt, 8, [255, stop_at]) == free[:first]
    assert sequence.stats.last_generation.stopped_by_eos
    assert runtime.open_sequence().generate(prompt, 8, np.int64(stop_at)) == free[:first]


def test_generate_without_eos_ids_stops_at_the_runtimes(reference_model, tmp_path):
    loaded = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W)
    assert loaded.stats.eos_token_ids == (2,)  # the reference decoder's genai_config.json
    prompt = list(range(1, 40))
    free = loaded.open_sequence().generate(prompt, 8, eos_token_id=[])
    model = copy_model(reference_model("base"), tmp_path / "model")
    config = json.loads((model.parent / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = free[2]
    (model.parent / "genai_config.json").write_text(json.dumps(config))
    stopping = load(model, provider="cpu", capacity=64, chunk_size=W)
    assert stopping.stats.eos_token_ids == (free[2],)
    sequence = stopping.open_sequence()
    assert sequence.generate(prompt, 8) == free[:free.index(free[2]) + 1]
    assert sequence.stats.last_generation.stopped_by_eos


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_closing_a_sequence_under_its_stream_never_hands_its_buffers_to_another(
        reference_model, variant):
    loaded = load(reference_model(variant), provider="cpu", capacity=64, chunk_size=W)
    prompt, other = list(range(3, 20)), list(range(40, 60))
    with loaded.open_sequence() as fresh:
        expected = fresh.generate(other, 6, eos_token_id=[])
    first = loaded.open_sequence()
    stream = first.stream(prompt, 6, eos_token_id=[])
    next(stream)
    first.close()
    second = loaded.open_sequence()
    assert second.buffers is not first.buffers  # still the stream's until it lets go
    with pytest.raises(Exception, match="closed"):
        next(stream)  # the closed sequence's stream ends at its next token
    assert second.generate(other, 6, eos_token_id=[]) == expected
    assert loaded.open_sequence().generate(other, 6, eos_token_id=[]) == expected
    with pytest.raises(Exception, match="closed"):
        first.generate(prompt, 2)


def test_after_the_runtime_closes_every_forward_and_submit_is_a_closed_error(reference_model):
    from onnx_chunk.errors import ClosedError

    loaded = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W)
    sequence = loaded.open_sequence()
    sequence.generate([5, 6, 7], 2)
    loaded.close()
    for call in (lambda: sequence.generate([5, 6], 2), lambda: sequence.prefill([5]),
                 lambda: loaded.submit([5], 2), lambda: loaded.open_sequence()):
        with pytest.raises(ClosedError, match="closed"):
            call()
    assert loaded.stats.capacity == 64


def test_idle_sequences_and_a_tiny_genai_max_length_are_refused_at_load(reference_model,
                                                                        tmp_path):
    import json
    import shutil

    with pytest.raises(ConfigError, match="idle_sequences"):
        load(reference_model("base"), provider="cpu", capacity=64, idle_sequences="3")
    folder = tmp_path / "model"
    shutil.copytree(reference_model("base").parent, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["max_length"] = 1
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="max_length gives a capacity of 1"):
        load(folder, provider="cpu")


def test_a_prompt_changed_after_submit_runs_as_it_was_checked(reference_model):
    runtime = load(reference_model(), capacity=64, chunk_size=8)
    prompt = np.array([5, 6, 7, 8, 9], dtype=np.int64)
    expected = runtime.generate_many([prompt], 3)[0]
    # The first request holds the engine's one slot, so the second waits in the queue.
    first = runtime.submit([1, 2, 3], 40)
    request = runtime.submit(prompt, 3)
    prompt[:] = 10 ** 6
    first.result()
    assert request.result() == expected
    runtime.close()


def test_a_sequence_cannot_start_a_forward_while_its_runtime_closes(reference_model):
    runtime = load(reference_model(), capacity=64, chunk_size=8)
    runtime.generate_many([[1, 2, 3]], 1)
    sequence = runtime.open_sequence()
    refused = []
    engine = runtime.debug.engine
    stop = engine.close

    def close_while_a_sequence_runs():
        # Another thread's forward, while the engine stops (close joins its thread).
        with pytest.raises(ClosedError):
            sequence.prefill([1, 2, 3])
        refused.append(True)
        stop()

    engine.close = close_while_a_sequence_runs
    runtime.close()
    assert refused == [True]
