"""The scheduler and the plan runner on their own, through their contract (`engine/plan.py`):
a `Scheduler` fed hand-built `Outputs` (no model), a `PlanRunner` running a hand-built `Plan`
on a fake model runner (no model), and the engine's step as the three calls between them."""

import inspect
import textwrap

import numpy as np
import pytest

from onnx_chunk.errors import CapacityError, InputError
from onnx_chunk.runtime.engine.batch_engine import BatchEngine
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.plan import Chunk, Outputs, Plan, Prefilled, Running
from onnx_chunk.runtime.engine.plan_runner import PlanRunner
from onnx_chunk.runtime.engine.prefix_reuse import SlotChoice
from onnx_chunk.runtime.engine.request import CheckedRequest, Request
from onnx_chunk.runtime.engine.scheduler import Scheduler
from onnx_chunk.runtime.engine.slots import CallerSlot
from onnx_chunk.runtime.runner.forward import Forward, Ran
from onnx_chunk.sampling import GREEDY, Sampler, Sampling

VOCAB = 8


def one_hot(token: int) -> np.ndarray:
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[token] = 1.0
    return logits


class FirstFreeSlots:
    """A slot policy of `count` slots that keeps nothing: each request takes the first free
    slot and starts it empty (what `EngineSlots` does with prefix reuse off)."""

    def __init__(self, count: int) -> None:
        self.slots = [f"slot {index}" for index in range(count)]
        self.lengths = [LogicalLength(64) for _ in range(count)]
        self.batch = "batch"
        self.kept: list[int] = []

    def choose(self, free, prompt, sampling):
        return SlotChoice(free[0], 0, 0)

    def start(self, choice):
        self.lengths[choice.slot].rewind(self.lengths[choice.slot].length)

    def keep(self, index, request, salt):
        self.kept.append(index)

    def drop(self, index):
        self.lengths[index].rewind(self.lengths[index].length)

    def fork(self, source, index):
        raise AssertionError("no choices are submitted here")

    def close(self):
        pass


def submit(scheduler: Scheduler, prompt_length: int, new_tokens: int) -> Request:
    request = Request(np.arange(prompt_length, dtype=np.int64), new_tokens, (7,),
                      scheduler.cancel)
    scheduler.add(request, Sampler(GREEDY, VOCAB))
    return request


def test_the_scheduler_plans_chunks_then_decodes_and_ends_requests_from_outputs():
    """Rules 3, 7 and 8 with no model: a 6-token prompt at W 4 is planned as a chunk of 4 then
    one of 2; the logits of its last chunk give its first token, the decode's logits the rest;
    a request whose forward failed ends "error"; every ended request is in its step's
    `finished`."""
    scheduler = Scheduler(FirstFreeSlots(2), chunk_size=4, batches_chunks=False)
    first = submit(scheduler, 6, 2)
    plan = scheduler.schedule()
    assert plan.running == 1 and not plan.decoding and not plan.drafts
    [[chunk]] = plan.rounds
    assert (chunk.begin, chunk.end, chunk.last, chunk.row.request) == (0, 4, False, first)
    step = scheduler.update(plan, Outputs(prefilled=[Prefilled(chunk, 4, 0.5, None)]))
    assert [(record.rows, record.width) for record in step.chunks] == [(4, 4)]
    assert not first.produced and not step.finished

    plan = scheduler.schedule()
    [[chunk]] = plan.rounds
    assert (chunk.begin, chunk.end, chunk.last) == (4, 6, True) and not plan.decoding
    scheduler.update(plan, Outputs(prefilled=[Prefilled(chunk, 2, 0.5, one_hot(3))]))
    assert first.produced == (3,)

    second = submit(scheduler, 3, 5)
    plan = scheduler.schedule()
    [[prompt]] = plan.rounds
    assert plan.decoding == [chunk.row] and plan.stalls and prompt.row.request is second
    decode = np.stack([one_hot(5), one_hot(0)])
    step = scheduler.update(plan, Outputs(
        decoded=plan.decoding, decode_logits=decode,
        failed=[(prompt.row, RuntimeError("the forward failed"))]))
    assert first.produced == (3, 5) and first.finish_reason == "length"
    assert second.finish_reason == "error"
    assert set(step.finished) == {first, second} and step.decode_rows == 1
    stats = scheduler.stats
    assert (stats.completed, stats.failed, stats.steps, stats.decode_stalls) == (1, 1, 3, 1)
    assert not scheduler.schedule().running and scheduler.slots.kept == [0, 1]


class FakeModelRunner:
    """Answers each forward with logits whose argmax is the number of forwards before it, and
    records what it was asked; `fail` names the forwards (by number) that raise."""

    batches_chunks = False

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.forwards: list[tuple[object, list[list[int]], str]] = []
        self.fail = fail

    def chunk_width(self, rows: int, room: int) -> int:
        return rows

    def run(self, slot: object, forward: Forward) -> Ran:
        number = len(self.forwards)
        self.forwards.append((slot, [row.tokens.tolist() for row in forward.rows],
                              forward.logits))
        if number in self.fail:
            raise RuntimeError(f"forward {number} failed")
        for row in forward.rows:
            if row.steps:
                row.length.advance(len(row.tokens))
        if forward.logits == "none":
            return Ran(None, forward.width, 0)
        last = np.stack([one_hot(number) for _ in forward.rows])
        if forward.logits == "last":
            return Ran(last, forward.width, 0)
        return Ran(np.repeat(last[:, None], forward.width, axis=1), forward.width, 0)


def running(index: int, prompt: list[int], token: int = 0, order: int = 0) -> Running:
    request = Request(np.array(prompt, dtype=np.int64), 4, (), lambda request: None)
    return Running(request, index, f"slot {index}", LogicalLength(64), Sampler(GREEDY, VOCAB),
                   order, token=token)


def test_the_plan_runner_runs_a_plan_in_order_and_leaves_a_failed_row_out():
    """Rules 1-6 with no model: the rounds' chunks (only a prompt's last chunk asks for
    logits), then each draft's verification (its last token and the draft, every row's logits),
    then one batched decode of every slot (free slots idle at their length); a forward that
    fails is recorded with its row, and that row's later forwards do not run."""
    model = FakeModelRunner(fail=(1,))
    lengths = [LogicalLength(64) for _ in range(4)]
    runner = PlanRunner(model, "batch", lengths, None)
    long, failing = running(0, list(range(6))), running(1, list(range(10, 16)), order=1)
    drafting, decoding = running(2, [4], token=5), running(3, [4], token=6)
    decoding.length = lengths[3]
    plan = Plan(rounds=[[Chunk(long, 0, 4), Chunk(failing, 0, 4)],
                        [Chunk(long, 4, 6), Chunk(failing, 4, 6)]],
                drafts=[(drafting, np.array([1, 2]))], decoding=[decoding], running=4)
    outputs = runner.run(plan)
    assert model.forwards == [
        ("slot 0", [[0, 1, 2, 3]], "none"),
        ("slot 1", [[10, 11, 12, 13]], "none"),
        ("slot 0", [[4, 5]], "last"),
        ("slot 2", [[5, 1, 2]], "all"),
        ("batch", [[0], [0], [0], [6]], "last"),
    ]
    assert [(item.chunk.begin, item.chunk.end, item.width) for item in outputs.prefilled] == [
        (0, 4, 4), (4, 6, 2)]
    assert outputs.prefilled[0].logits is None
    assert int(np.argmax(outputs.prefilled[1].logits)) == 2
    [(row, error)] = outputs.failed
    assert row is failing and "forward 1 failed" in str(error)
    [verified] = outputs.verified
    assert verified.row is drafting and verified.logits.shape == (3, VOCAB)
    assert int(np.argmax(verified.logits[-1])) == 3
    assert outputs.decoded == [decoding] and outputs.decode_ran
    assert int(np.argmax(outputs.decode_logits[3])) == 4
    assert [length.length for length in lengths] == [0, 0, 0, 1]


def test_a_lone_sequence_slot_keeps_and_resets_nothing():
    """The lone sequence's policy: its one slot is the batch's, a request continues at the
    sequence's length, and an ended request leaves the length where it was."""
    length = LogicalLength(64)
    length.advance(10)
    policy = CallerSlot("the sequence's slot", length)
    assert policy.slots == ["the sequence's slot"] and policy.batch == "the sequence's slot"
    scheduler = Scheduler(policy, chunk_size=4, batches_chunks=False, max_queue=1)
    request = submit(scheduler, 3, 1)
    plan = scheduler.schedule()
    assert plan.rounds[0][0].row.length is length and length.length == 10
    request.finish("cancelled")
    assert not scheduler.schedule().running and length.length == 10
    with pytest.raises(InputError, match="one choice"):
        policy.fork(0, 0)


def test_the_step_is_schedule_run_update():
    """`BatchEngine.step` is the three calls and nothing else (at most 10 lines)."""
    source = textwrap.dedent(inspect.getsource(BatchEngine.step))
    body = source.split('"""')[2].strip().splitlines()
    assert len(body) <= 10
    code = "\n".join(body)
    assert ("self.scheduler.schedule()" in code
            and "self.scheduler.update(plan, self.runner.run(plan))" in code)


def test_a_request_is_checked_by_one_set_of_rules():
    """`CheckedRequest.check`, which the runtime, a sequence and the static runner call: the
    prompt, a tokens-only refusal, max_new_tokens (0 only for a prompt's logprobs), the room,
    the end ids (or the default), and a sampler that has seen the prompt."""
    check = CheckedRequest.check
    room = LogicalLength(16)
    room.advance(6)
    with pytest.raises(InputError, match="outside the vocabulary"):
        check([1, VOCAB], 2, None, None, vocab=VOCAB)
    with pytest.raises(InputError, match="ask elsewhere"):
        check([1], 2, None, Sampling(logprobs=1), vocab=VOCAB, tokens_only="ask elsewhere")
    with pytest.raises(InputError, match="at least 1, got 0"):
        check([1], 0, None, None, vocab=VOCAB)
    assert check([1], 0, None, Sampling(prompt_logprobs=1), vocab=VOCAB).max_new_tokens == 0
    with pytest.raises(CapacityError, match="needs 11 positions .*holds 6 .*10 left"):
        check([1, 2, 3], 8, None, None, vocab=VOCAB, room=room)
    with pytest.raises(CapacityError, match="needs 17 positions, more than the KV capacity 16"):
        check([1], 16, None, None, vocab=VOCAB, room=LogicalLength(16))
    with pytest.raises(InputError, match="eos_token_id"):
        check([1], 2, VOCAB, None, vocab=VOCAB)
    assert check([1], 2, None, None, vocab=VOCAB, eos_default=(7,)).stop_ids == (7,)
    checked = check(np.array([2, 2, 5]), 3, [4, 6], Sampling(repetition_penalty=2.0),
                    vocab=VOCAB, room=room)
    assert checked.prompt.tolist() == [2, 2, 5] and checked.stop_ids == (4, 6)
    # The penalty halves the logits of the prompt's ids: 2 no longer beats 3.
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[2], logits[3] = 1.0, 0.6
    assert checked.sampler.choose(logits) == 3
