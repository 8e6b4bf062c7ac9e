"""The batch engine: many sequences on one loaded decoder, advanced together step by step.

`step()` is the one generation loop's body, whoever drives it: `Runtime.submit` queues a
`Request` and a background thread (started by the first submit, left when nothing is queued or
running, stopped by `Runtime.close()`) calls `step()` while there is work; `Runtime.step()`
runs one step in the caller's thread, and a step lock keeps every step, the thread's and a
caller's, one at a time. A lone sequence's `generate`/`stream` is a request on the same engine
over a `CallerSlot` (`lone_engine`): one slot over the sequence's own buffers and length,
stepped by its stream alone (no thread). The engine sees its runtime through an
`EngineContext` (the model runner, ports, device, sizes, the mask policy and graph slot
numbers), never the runtime itself.

A step, as nano-vllm's `LLMEngine.step` (nanovllm/engine/llm_engine.py): the scheduler plans
(`Scheduler.schedule() -> Plan`: free the slots of ended requests, admit queued ones into free
slots, prefix reuse included, and pick the step's prefill chunks, drafts to verify and decode
rows), the plan runner runs the plan's forwards (`PlanRunner.run(plan) -> Outputs`), and the
scheduler updates (`Scheduler.update(plan, outputs)`: choose every row's tokens, count,
deliver, finish). A failure in a forward fails the requests of that forward (their slots are
freed, keeping nothing); the other requests go on. `step()` returns a `StepResult`.

What a slot keeps (`slots.EngineSlots`): its logical length (one `LogicalLength` per slot,
lent to the request it serves) and the ids fed to it, the prompt then the generated tokens up
to that length (`KeptPrefix`): copying a slot's KV rows and state rows to another slot with
its kept prefix makes that slot hold the same prefix. A free slot's row runs in the batched
decode at its kept length, so its write lands past the kept positions (and a window-sized
cache's rows are protected as any idle row's).

Choices of one prompt (`submit_choices`, OpenAI's `n`): the first is queued and prefilled like
any request; the others wait beside it. In the update of the step its last prefill chunk ran
in, each other choice takes a free slot, the first's KV and state rows are copied into it on
the device (`BatchBuffers.copy_slot`), and it chooses its first token from the same logits
with its own sampler; from then on every choice decodes as a request of its own. A choice
that finds no free slot, or whose first choice ended before its prefill did, is queued at the
head as a request of its own (it runs its own prefill).

Shapes per provider: prefill chunks run at batch 1 at the ladder widths (or the shape-generic
session on CPU), decode at one fixed batch width of `slots` rows on the decode variant; the
batch axis is left free in every session, so the variant cache holds what a lone sequence's
holds (CUDA: the prefill tiers and one decode variant within the cap). The CUDA provider keeps
its graphs per thread, so a step in another thread than the last batched decode's drops the
batched binding's graphs first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from onnx_chunk.errors import ClosedError
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.engine.counters import EngineStats
from onnx_chunk.runtime.engine.kv_state import RowLength
from onnx_chunk.runtime.engine.plan import StepResult
from onnx_chunk.runtime.engine.plan_runner import Forwards, PlanRunner
from onnx_chunk.runtime.engine.prefix_reuse import PrefixRule
from onnx_chunk.runtime.engine.request import CheckedRequest, Request
from onnx_chunk.runtime.engine.scheduler import Scheduler
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.engine.slots import CallerSlot, EngineSlots
from onnx_chunk.runtime.engine.speculation import Speculation
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.runner.model_runner import ModelRunner
from onnx_chunk.runtime.state.ports import ModelPorts

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
# The engine thread leaves after this long with nothing to do (the next submit starts one).
_IDLE_EXIT_S = 1.0
_IDLE = StepResult()


@dataclass(frozen=True)
class EngineContext:
    """What the batch engine uses of its runtime: the runner and what its slots are made of.

    `take_number` / `give_number`: graph slot numbers for the engine's buffers;
    `release_graphs(number)`: drop the bindings and CUDA graphs held under a number;
    `prefix_reuse`: whether a slot keeps its prefix for later requests (see the module
    docstring); `exact`: exact mode's reuse rule (scheduler rule 5).
    """

    runner: ModelRunner
    ports: ModelPorts
    device: Device
    capacity: int
    chunk_size: int
    masks: type[AttentionMask]
    take_number: Callable[[], int]
    give_number: Callable[[int], None]
    release_graphs: Callable[[int], None]
    prefix_reuse: bool = True
    speculation: Speculation | None = None
    exact: bool = False


class BatchEngine:
    """The engine of one runtime, or of one lone sequence (see the module docstring): a
    scheduler and the plan runner of its slots.

    `threaded`: the first submit starts the background thread that steps while there is work;
    False: no thread, the caller drives every step (`step()`).
    """

    def __init__(self, scheduler: Scheduler, runner: PlanRunner, *,
                 threaded: bool = True) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.slots = len(scheduler.slots.slots)
        self._threaded = threaded
        # Held for a whole step: the thread's steps and a caller's run one at a time.
        self._stepping = threading.RLock()
        self._thread: threading.Thread | None = None

    def step(self) -> StepResult:
        """One step (see the module docstring): schedule, run, update. Callable from any thread
        (the step lock runs it between the engine thread's steps). A defect of the step itself
        (not of a forward, which fails its own requests) fails every running request."""
        with self._stepping:
            try:
                plan = self.scheduler.schedule()
                if not plan.running:
                    return _IDLE
                return self.scheduler.update(plan, self.runner.run(plan))
            except Exception as error:  # a defect in the step itself: fail, never hang
                return self.scheduler.fail_running(error)

    def submit(self, checked: CheckedRequest, *, wait: bool = False) -> Request:
        """Queue a checked request; QueueFullError when the queue is full (unless `wait`:
        then wait for room)."""
        return self.submit_choices([checked], wait=wait)[0]

    def submit_choices(self, checked: list[CheckedRequest], *,
                       wait: bool = False) -> list[Request]:
        """Queue one request per checked request of the same prompt (the first's prompt, new
        tokens and end ids; each one's sampler), prefilled once (see the module docstring);
        QueueFullError as `submit` (the group takes one place in the queue)."""
        head = checked[0]

        def new() -> Request:
            return Request(head.prompt, head.max_new_tokens, head.stop_ids, self.cancel)

        others = [(new(), other.sampler) for other in checked[1:]]
        first = new()
        with self.scheduler.lock:
            self.scheduler.add(first, head.sampler, others, wait=wait)
            if self._threaded and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="onnx-chunk-engine",
                                                daemon=True)
                self._thread.start()
        return [first, *(request for request, _ in others)]

    def cancel(self, request: Request) -> None:
        """End `request` now; its slot (or its place in the queue) is freed at once."""
        self.scheduler.cancel(request)

    @property
    def batch_number(self) -> int:
        """The slot number of the batched decode's buffers (its bindings and graphs hang off
        it, as a sequence's off its slot)."""
        batch = self.scheduler.slots.batch
        assert isinstance(batch, SequenceSlot)  # a runtime's engine (`runtime_engine`)
        return batch.number

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    def close(self) -> None:
        """Stop the thread; queued and running requests fail with ClosedError."""
        scheduler = self.scheduler
        with scheduler.lock:
            if scheduler.closed:
                return
            scheduler.closed = True
            thread = self._thread
            scheduler.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        # A caller's step under way ends first (reentrant: a close from a step's callback).
        with self._stepping:
            scheduler.fail_all(ClosedError("the runtime was closed before this request "
                                           "finished"))
        scheduler.slots.close()

    def release(self) -> None:
        """Forget every request and the pinned decode (a lone sequence's engine, once its
        caller is done with them). A request's cancel is its engine's bound method, so engine
        and request form a cycle that holds the runner (and its sessions) until the garbage
        collector runs; the sequence's resources must go when its last reference does."""
        self.scheduler.forget()
        self.runner.decode = None

    def _loop(self) -> None:
        try:
            while self._work():
                self.step()
        except BaseException as error:  # a defect outside any step: never leave requests hanging
            logger.exception("the engine thread stopped")
            with self.scheduler.lock:
                self._thread = None
                self.scheduler.fail_all(error)
            raise

    def _work(self) -> bool:
        """Wait for work; False when the thread is to leave (closed, or idle for
        `_IDLE_EXIT_S`)."""
        scheduler = self.scheduler
        with scheduler.lock:
            while not scheduler.closed:
                if scheduler.has_work:
                    return True
                if not scheduler.cond.wait(_IDLE_EXIT_S) and not scheduler.has_work:
                    break
            self._thread = None
            return False


def runtime_engine(context: EngineContext, slots: int, max_queue: int = DEFAULT_MAX_QUEUE, *,
                   threaded: bool = True) -> BatchEngine:
    """The engine of a runtime: `slots` rows of one set of batch buffers, prefix reuse as the
    context says, at most `max_queue` requests waiting."""
    ports, device, capacity = context.ports, context.device, context.capacity
    buffers = BatchBuffers(ports.kv, ports.state, device, slots)
    # The batched decode's slot: every row of the buffers, a [slots, capacity] mask.
    batch = SequenceSlot(context.take_number(), buffers,
                         context.masks(slots, capacity, ports.mask_dtype, device))
    rows = [new_slot(ports, capacity, device, context.masks, context.take_number(),
                     buffers=buffers.slot(index), captures=False) for index in range(slots)]
    rule = PrefixRule(windows=tuple((port.shape[2], port.window) for port in ports.kv
                                    if port.window is not None),
                      recurrent=bool(ports.state), enabled=context.prefix_reuse,
                      exact=context.exact)
    policy = EngineSlots(rows, batch, buffers, capacity, rule, context.give_number)
    scheduler = Scheduler(policy, chunk_size=context.chunk_size,
                          batches_chunks=context.runner.batches_chunks,
                          speculation=context.speculation, max_queue=max_queue)
    runner = PlanRunner(context.runner, batch, policy.lengths, context.release_graphs)
    return BatchEngine(scheduler, runner, threaded=threaded)


def lone_engine(runner: Forwards, slot: object, length: RowLength, *,
                chunk_size: int, speculation: Speculation | None) -> BatchEngine:
    """A lone engine: one caller-owned slot (`CallerSlot`), stepped by its caller alone (no
    thread). A sequence's: over its own buffers and logical length, its decode on
    `runner.decode`, the model runner's step on the pinned decode variant
    (`ModelRunner.decoding`), which the caller sets once the first token came. A static
    request's: over its cache and length, on its graphs (`onnx_chunk.static.runner`)."""
    policy = CallerSlot(slot, length)
    scheduler = Scheduler(policy, chunk_size=chunk_size, batches_chunks=runner.batches_chunks,
                          speculation=speculation, max_queue=1)
    return BatchEngine(scheduler, PlanRunner(runner, slot, policy.lengths, None),
                       threaded=False)
