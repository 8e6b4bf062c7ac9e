"""The batch engine: greedy parity with each request run alone, idle rows left intact, the
variant cache bounded, the Request API (stream, result, cancel, queue, errors, close)."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from onnx_chunk.errors import CapacityError, ClosedError, ConfigError, InputError, QueueFullError
from onnx_chunk.runtime import StepResult, facade, load
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.engine.batch_engine import EngineContext, runtime_engine
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.request import CheckedRequest
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.runner.model_runner import Forward, ModelRunner, Row
from onnx_chunk.sampling import Sampling
from tests.exports.corpus import builder_gqa_fixtures

W = 16
# Lengths around the chunk width: one row, remainders, several chunks, a 1-row remainder.
LENGTHS = (5, 40, 17, 1, 64, 33, 9)
NEW_TOKENS = 10


def prompts_for(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for length in lengths]


def alone(runtime, prompts, new_tokens=NEW_TOKENS, **options) -> list[list[int]]:
    results = []
    for prompt in prompts:
        with runtime.open_sequence() as sequence:
            results.append(sequence.generate(prompt, new_tokens, [], **options))
    return results


def assert_batched_equals_alone(path, max_batch: int):
    """The batched greedy tokens of `LENGTHS` prompts equal each one alone; the engine stats."""
    single = load(path, provider="cpu", capacity=128, chunk_size=W)
    prompts = prompts_for(single.stats.vocab_size)
    expected = alone(single, prompts)
    with load(path, provider="cpu", capacity=128, chunk_size=W, max_batch=max_batch) as batched:
        assert batched.generate_many(prompts, NEW_TOKENS, eos_token_id=[]) == expected
        return batched.stats.engine


@pytest.mark.parametrize("variant", ["base", "int4", "position_ids", "conv_hybrid",
                                     "inputs_embeds", "last_token_logits"])
def test_greedy_tokens_equal_each_request_run_alone(reference_model, variant):
    stats = assert_batched_equals_alone(reference_model(variant), max_batch=3)
    # Decodes really ran batched, and prompts were admitted while others decoded.
    assert stats.rows_per_decode_step > 1.5
    assert stats.decode_stalls > 0 and stats.completed == len(LENGTHS)


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_parity_on_the_device_path_with_the_capacity_mask(reference_model, monkeypatch, variant):
    """The CPU marked not host-visible, as CUDA looks: rows copied through device buffers,
    the capacity-wide mask, per-width variants with ladder padding."""
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    assert_batched_equals_alone(reference_model(variant), max_batch=4)


@pytest.mark.parametrize("fixture", builder_gqa_fixtures(), ids=str)
def test_greedy_parity_on_the_real_exports(fixture):
    """llama, qwen3, phi3, gemma2 (sliding window: prompts longer than its window-sized
    cache, so idle rows between chunks would evict), lfm2 (conv state); fp32 and INT4."""
    single = load(fixture.folder, provider="cpu", chunk_size=W)
    prompts = prompts_for(single.stats.vocab_size, (5, 64, 17, 130), seed=1)
    expected = alone(single, prompts, 12)
    with load(fixture.folder, provider="cpu", chunk_size=W, max_batch=3) as batched:
        assert batched.generate_many(prompts, 12, eos_token_id=[]) == expected


def _row_slot(runtime, buffers, index):
    """Row `index` of `buffers` as a slot, the way the engine makes its rows' slots."""
    debug = runtime.debug
    return new_slot(debug.ports, debug.options.capacity, debug.device, debug.masks,
                    debug.pool.take_number(), buffers=buffers.slot(index), captures=False)


def _prefill(runtime, slot, prompt):
    """Feed `prompt` into `slot` chunk by chunk, as the engine does."""
    length, ids = LogicalLength(runtime.stats.capacity), np.asarray(prompt)
    for begin, end in prefill_chunks(len(ids), runtime.stats.chunk_size):
        runtime.debug.runner.run(slot, Forward([Row(ids[begin:end], length)]))


def test_a_slots_prefill_writes_in_place_into_its_row_of_the_batch_buffers(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W)
    ports = runtime.debug.ports
    buffers = BatchBuffers(ports.kv, ports.state, runtime.debug.device, 3)
    slot = _row_slot(runtime, buffers, 1)
    prompt = list(range(3, 30))
    _prefill(runtime, slot, prompt)
    with runtime.open_sequence() as reference:
        reference.prefill(prompt)
        for batch, own in zip(buffers.kv, reference.buffers.kv):
            assert np.array_equal(batch.host[1, :, :len(prompt)], own.host[0, :, :len(prompt)])
            assert not batch.host[0].any() and not batch.host[2].any()


def test_a_decode_step_leaves_idle_rows_state_as_it_was(reference_model):
    runtime = load(reference_model("conv_hybrid"), provider="cpu", capacity=64, chunk_size=W,
                   max_batch=2)
    ports = runtime.debug.ports
    buffers = BatchBuffers(ports.kv, ports.state, runtime.debug.device, 2)
    slots = [_row_slot(runtime, buffers, index) for index in range(2)]
    _prefill(runtime, slots[0], [1, 2, 3])
    _prefill(runtime, slots[1], [4, 5, 6, 7])
    before = buffers.slot(1).snapshot_state()
    capacity = runtime.stats.capacity
    batch = SequenceSlot(runtime.debug.pool.take_number(), buffers,
                         runtime.debug.masks(2, capacity, ports.mask_dtype, runtime.debug.device))
    lengths = [LogicalLength(capacity), LogicalLength(capacity)]
    lengths[0].advance(3)
    lengths[1].advance(4)
    runtime.debug.runner.run(batch, Forward([Row(np.array([9]), lengths[0]),
                                       Row(np.array([0]), lengths[1], steps=False)]))
    assert [length.length for length in lengths] == [4, 4]
    after = buffers.slot(1).snapshot_state()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert not all(np.array_equal(a, b) for a, b in
                   zip(before, buffers.slot(0).snapshot_state()))


def test_a_long_mixed_run_builds_no_variant_after_warm_up(reference_model):
    """Per-width variants with padding: 3 prefill tiers and 1 decode variant within cap 4."""
    path = reference_model("base")
    with load(path, provider="cpu", capacity=256, chunk_size=W, specialize=True, padding=True,
              max_variants=4, max_batch=4) as runtime:
        vocab = runtime.stats.vocab_size
        warm = prompts_for(vocab, (2, 6, 11, 16, 1))
        runtime.generate_many(warm, 4, eos_token_id=[])
        built = runtime.stats.cache.compiles
        assert built == 4
        lengths = np.random.default_rng(5).integers(1, 90, 40).tolist()
        runtime.generate_many(prompts_for(vocab, lengths, seed=2), 6, eos_token_id=[])
        cache = runtime.stats.cache
    assert cache.compiles == built and cache.evictions == 0 and cache.peak_variants <= 4


@pytest.fixture(scope="module")
def batched(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=512, chunk_size=W,
                   max_batch=2, max_queue=2)
    yield runtime
    runtime.close()


def test_submit_streams_tokens_and_reports_how_it_ended(batched):
    request = batched.submit([1, 2, 3], 6, eos_token_id=[])
    streamed = list(request.tokens())
    assert streamed == request.result() and len(streamed) == 6
    assert request.finish_reason == "length"
    stats = request.stats
    assert stats.new_tokens == 6 and stats.prompt_tokens == 3 and stats.prefill_chunks == 1
    assert 0 <= stats.queued_s <= stats.ttft_s <= stats.total_s
    first = streamed[0]
    assert not any(request.ends_at(count) for count in range(8))
    stopped = batched.submit([1, 2, 3], 6, eos_token_id=first)
    assert stopped.result() == [first] and stopped.finish_reason == "stop"
    assert stopped.ends_at(1) and not stopped.ends_at(0) and not stopped.ends_at(2)


def test_sampling_is_per_request_and_equals_the_same_request_alone(batched):
    sampling = Sampling(temperature=0.9, top_k=20, seed=7)
    prompts = prompts_for(batched.stats.vocab_size, (4, 20, 9))
    expected = alone(batched, prompts, 8, sampling=sampling)
    assert batched.generate_many(prompts, 8, eos_token_id=[], sampling=sampling) == expected


def test_a_long_prompt_enters_one_chunk_per_step_while_others_decode(batched):
    short_at = time.perf_counter()
    short = batched.submit([1, 2, 3, 4, 5], 5, eos_token_id=[])
    long_at = time.perf_counter()
    long = batched.submit(list(range(1, 201)), 2, eos_token_id=[])
    short.result(), long.result()
    # 200 tokens take 13 chunks of 16: the short request ran all its decodes in between. Each
    # request's times count from its own submit, and the engine may run steps between the two
    # submits (the session is built at load), so the ends are compared on one clock.
    assert long.stats.prefill_chunks == 13
    assert short_at + short.stats.total_s < long_at + long.stats.ttft_s


def _running(runtime, prompt_length=3):
    """A request that has produced its first token and goes on for a long time."""
    request = runtime.submit(list(range(1, prompt_length + 1)), 500, eos_token_id=[])
    next(request.tokens())
    return request


def test_a_full_queue_is_a_typed_error_and_cancel_frees_a_slot_at_once(batched):
    running = [_running(batched), _running(batched)]
    queued = [batched.submit([7, 8], 3, eos_token_id=[]) for _ in range(2)]
    with pytest.raises(QueueFullError, match="2 requests wait"):
        batched.submit([7, 8], 3)
    assert batched.stats.engine.queued == 2
    queued[1].cancel()
    assert queued[1].finish_reason == "cancelled" and queued[1].result() == []
    running[0].cancel()
    assert running[0].finish_reason == "cancelled"
    assert len(queued[0].result()) == 3
    running[1].cancel()
    assert len(running[1].result()) < 500


def test_bad_requests_are_refused_at_submit(batched):
    with pytest.raises(InputError, match="empty"):
        batched.submit([], 3)
    with pytest.raises(InputError, match="outside the vocabulary"):
        batched.submit([1, 10**6], 3)
    with pytest.raises(CapacityError, match="510 tokens plus 5 new tokens"):
        batched.submit([1] * 510, 5)
    with pytest.raises(InputError):
        batched.submit([1], 0)


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on(batched, monkeypatch):
    broken = RuntimeError("decode forward failed")

    def fail(*args, **kwargs):
        raise broken

    run = ModelRunner.run

    def fail_batched(self, slot, forward):
        if len(forward.rows) > 1:
            raise broken
        return run(self, slot, forward)

    monkeypatch.setattr(ModelRunner, "run", fail_batched)
    request = batched.submit([1, 2, 3], 4, eos_token_id=[])
    with pytest.raises(RuntimeError, match="decode forward failed"):
        request.result(timeout=30)
    assert request.finish_reason == "error" and request.stats.new_tokens == 1
    with pytest.raises(RuntimeError):
        list(request.tokens())
    monkeypatch.undo()
    assert len(batched.submit([1, 2, 3], 4, eos_token_id=[]).result(timeout=30)) == 4


def test_a_failing_prefill_fails_that_request_alone(batched, monkeypatch):
    run = ModelRunner.run

    def fail_long(self, slot, forward):
        # The bad prompt's last id: always fed by a prefill forward, whatever a slot kept.
        if len(forward.rows) == 1 and 98 in forward.rows[0].tokens:
            raise RuntimeError("prefill forward failed")
        return run(self, slot, forward)

    monkeypatch.setattr(ModelRunner, "run", fail_long)
    good, bad = (batched.submit(list(range(1, 6)), 4, eos_token_id=[]),
                 batched.submit([*range(1, 11), 98], 4, eos_token_id=[]))
    assert len(good.result(timeout=30)) == 4
    with pytest.raises(RuntimeError, match="prefill forward failed"):
        bad.result(timeout=30)
    assert batched.stats.engine.failed >= 1


def test_submit_from_many_threads(batched):
    prompts = prompts_for(batched.stats.vocab_size, (3, 18, 7, 25, 2, 11))
    expected = alone(batched, prompts, 5)
    results: dict[int, list[int]] = {}

    def run(index):
        results[index] = batched.submit(prompts[index], 5, eos_token_id=[], wait=True).result()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[index] for index in range(len(prompts))] == expected


def test_close_fails_what_is_left_and_refuses_new_requests(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=512, chunk_size=W,
                   max_batch=1)
    running = _running(runtime)
    waiting = runtime.submit([1, 2], 3)
    runtime.close()
    for request in (running, waiting):
        assert request.finish_reason == "error"
        with pytest.raises(ClosedError):
            request.result()
    with pytest.raises(ClosedError):
        runtime.submit([1, 2], 3)


def test_max_batch_is_checked(reference_model):
    with pytest.raises(ConfigError, match="max_batch"):
        load(reference_model("base"), provider="cpu", max_batch=0)


def test_a_runtime_whose_engine_ran_is_freed_with_its_last_reference(reference_model):
    import gc
    import weakref

    runtime = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W,
                   max_batch=2)
    assert len(runtime.submit([1, 2, 3], 3, eos_token_id=[]).result()) == 3
    freed = weakref.ref(runtime)
    gc.disable()
    try:
        del runtime
        assert freed() is None
    finally:
        gc.enable()


def test_a_decoder_with_a_fixed_batch_axis_is_refused_for_max_batch(reference_model, tmp_path):
    import shutil

    import onnx
    from onnxruntime.tools.onnx_model_utils import make_dim_param_fixed

    folder = tmp_path / "fixed"
    shutil.copytree(reference_model("base").parent, folder)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    make_dim_param_fixed(model.graph, "batch_size", 1)
    onnx.save(model, str(folder / "model.onnx"))
    with pytest.raises(ConfigError, match="max_batch=2 needs a decoder whose batch axis is free"):
        load(folder, provider="cpu", max_batch=2)
    assert load(folder, provider="cpu", capacity=64).generate_many([[1, 2, 3]], 2) != []


@pytest.mark.parametrize("new_tokens", [1, 6])  # 1: the choice after prefill; 6: in decode
def test_one_requests_failing_token_choice_fails_it_alone(reference_model, monkeypatch,
                                                         new_tokens):
    from onnx_chunk import sampling

    runtime = load(reference_model("base"), provider="cpu", capacity=64, max_batch=4)
    healthy = runtime.open_sequence().generate(list(range(3, 30)), 8, eos_token_id=[])
    choose = sampling.Sampler.choose

    def broken(self, logits):
        if self.sampling.seed == 13:
            raise ValueError("broken logits")
        return choose(self, logits)

    monkeypatch.setattr(sampling.Sampler, "choose", broken)
    good = runtime.submit(list(range(3, 30)), 8, eos_token_id=[])
    bad = runtime.submit(list(range(5, 12)), new_tokens, eos_token_id=[],
                         sampling=Sampling(temperature=0.5, seed=13))
    assert good.result(timeout=60) == healthy and good.finish_reason == "length"
    with pytest.raises(ValueError, match="broken logits"):
        bad.result(timeout=60)
    runtime.close()


def test_a_failure_admitting_a_request_fails_it_alone_and_the_engine_goes_on(reference_model,
                                                                            monkeypatch):
    runtime = load(reference_model("base"), provider="cpu", capacity=64, max_batch=2)
    expected = runtime.open_sequence().generate([7, 8, 9], 4, eos_token_id=[])
    reset = SequenceSlot.reset
    failures = [RuntimeError("transient device error")]

    def flaky(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        return reset(self, *args, **kwargs)

    monkeypatch.setattr(SequenceSlot, "reset", flaky)
    first = runtime.submit([7, 8, 9], 4, eos_token_id=[])
    with pytest.raises(RuntimeError, match="transient"):
        first.result(timeout=60)
    assert runtime.submit([7, 8, 9], 4, eos_token_id=[]).result(timeout=60) == expected
    runtime.close()


def test_a_prompts_last_chunk_gives_its_first_token_and_it_decodes_from_the_next_step(
        reference_model):
    """One request of one chunk and 3 new tokens: a prefill step, then two decode steps (the
    counters read once the engine stopped, its last step counted)."""
    with load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W,
              max_batch=2) as runtime:
        assert len(runtime.submit([1, 2, 3, 4, 5], 3, eos_token_id=[]).result(timeout=60)) == 3
    stats = runtime.stats.engine
    assert (stats.steps, stats.decode_steps, stats.prefill_chunks) == (3, 2, 1)


def test_a_caller_may_step_the_engine_between_its_threads_steps(reference_model):
    """`runtime.step()` runs steps in the caller's thread while the engine thread runs its own:
    the step lock keeps them one at a time, so every request's tokens stay its own."""
    with load(reference_model("base"), provider="cpu", capacity=128, chunk_size=W,
              max_batch=2) as runtime:
        idle = runtime.step()
        assert isinstance(idle, StepResult) and not idle.ran and idle == StepResult()
        assert runtime.stats.engine is None  # an empty step makes no engine
        prompts = prompts_for(runtime.stats.vocab_size, (5, 40, 17))
        expected = alone(runtime, prompts)
        requests = [runtime.submit(prompt, NEW_TOKENS, eos_token_id=[]) for prompt in prompts]
        steps = []
        while not all(request.done for request in requests):
            steps.append(runtime.step())
        assert [request.result() for request in requests] == expected
        assert all(isinstance(step, StepResult) for step in steps)
        ran = [step for step in steps if step.ran]
        assert all(step.decode_rows <= 2 for step in ran)
        assert all(chunk.rows <= W for step in ran for chunk in step.chunks)
    with pytest.raises(ClosedError, match="closed"):
        runtime.step()


def test_a_sequences_generation_steps_in_its_callers_thread(reference_model):
    """A sequence's stream steps its one-slot engine itself: no thread is started, and its
    stats are those of the steps it ran (two chunks of a 20-token prompt at W 16)."""
    runtime = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=W)
    before = {thread.ident for thread in threading.enumerate()}
    with runtime.open_sequence() as sequence:
        tokens = sequence.generate(list(range(3, 23)), 4, [])
        started = {thread.ident for thread in threading.enumerate()} - before
        stats = sequence.stats
    assert len(tokens) == 4 and not started
    generation = stats.last_generation
    assert [chunk.rows for chunk in generation.chunks] == [16, 4]
    assert (stats.prefill_forwards, stats.decode_forwards) == (2, 3)
    assert generation.new_tokens == 4 and generation.ttft_s > 0 and generation.decode_s > 0


def test_a_caller_driven_engine_runs_what_each_step_schedules(reference_model):
    """A `threaded=False` engine steps only when its caller says: a lone prompt's prefill step
    gives its first token and decodes nothing; a prompt whose last chunk runs while another
    row decodes gives its first token in that step and decodes from the next; the tokens equal
    each prompt alone (the runtime's sessions leave the batch axis free for two rows:
    max_batch=2)."""
    runtime = load(reference_model("base"), provider="cpu", capacity=128, chunk_size=W,
                   max_batch=2)
    first, second = prompts_for(runtime.stats.vocab_size, (20, 5))
    expected = alone(runtime, [first, second], 6)
    debug = runtime.debug
    context = EngineContext(runner=debug.runner, ports=debug.ports, device=debug.device,
                            capacity=128, chunk_size=W, masks=debug.masks,
                            take_number=debug.pool.take_number,
                            give_number=debug.pool.give_number,
                            release_graphs=debug.variants.claim)
    threads = {thread.ident for thread in threading.enumerate()}
    engine = runtime_engine(context, 2, threaded=False)
    vocab = runtime.stats.vocab_size
    one = engine.submit(CheckedRequest.check(first, 6, (), None, vocab=vocab))
    assert engine.stats.queued == 1 and not one.produced  # nothing runs until a step
    steps = [engine.step(), engine.step()]
    # 20 tokens at W 16: a chunk of 16, then the remainder of 4 and the first token.
    assert [[chunk.rows for chunk in step.chunks] for step in steps] == [[16], [4]]
    assert [step.decode_rows for step in steps] == [0, 0] and len(one.produced) == 1
    decoded = engine.step()
    assert not decoded.chunks and decoded.decode_rows == 1 and len(one.produced) == 2
    two = engine.submit(CheckedRequest.check(second, 6, (), None, vocab=vocab))
    prefilled = engine.step()
    assert [chunk.rows for chunk in prefilled.chunks] == [5] and prefilled.decode_rows == 1
    assert (len(one.produced), len(two.produced)) == (3, 1)
    both = engine.step()
    assert not both.chunks and both.decode_rows == 2 and len(two.produced) == 2
    while not (one.done and two.done):
        assert engine.step().ran
    assert not engine.step().ran
    assert [one.result(), two.result()] == expected
    assert {thread.ident for thread in threading.enumerate()} <= threads
    engine.close()
