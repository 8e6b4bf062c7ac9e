"""The batch engine: many sequences on one loaded decoder, advanced together step by step.

`Runtime.submit` queues a `Request`; a background thread (started by the first submit, left
when nothing is queued or running, stopped by `Runtime.close()`) runs steps. The engine sees
its runtime through an `EngineContext` (the model runner, ports, device, sizes, the mask
policy and graph slot numbers), never the runtime itself. A step:
1. frees the slots of requests that ended (finished, failed, cancelled) and gives free slots
   to the queue's head requests (`scheduler.admit`);
2. runs prefill chunks of the prompts being admitted, in admission order, under a token budget
   of one chunk width W (`scheduler.prefill_picks`): each chunk is a one-row forward of that
   slot (the model runner's, on a row of the engine's buffers, with the ladder padding and
   variant cache of any sequence), and a prompt's last chunk gives its first token;
3. with speculative decoding, verifies each decoding row's draft (if it has one this step) in
   a forward of its own slot, as a prefill chunk runs (`speculation`);
4. runs one batched decode forward of every slot through the same runner: each decoding row
   without a draft feeds its last token, and every other row is run but left as it was
   (`idle_rows`). On a capturing session the batched binding captures and replays a CUDA
   graph like any other.
A failure in a forward fails the requests of that forward with the exception (their slots are
freed); the other requests go on.

Shapes per provider: prefill chunks run at batch 1 at the ladder widths (or the shape-generic
session on CPU), decode at one fixed batch width of `slots` rows on the decode variant; the
batch axis is left free in every session, so the variant cache holds what a lone sequence's
holds (CUDA: the prefill tiers and one decode variant within the cap). The CUDA provider keeps
its graphs per thread, so a new engine thread drops the batched binding's graphs first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from onnx_chunk.errors import ClosedError
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.request import FinishReason, Request
from onnx_chunk.runtime.engine.scheduler import RequestQueue, admit, prefill_chunks, prefill_picks
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.engine.speculation import Drafter, Speculation, accepted
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.runner.model_runner import Forward, ModelRunner, Row
from onnx_chunk.runtime.runner.ports import ModelPorts
from onnx_chunk.runtime.stats import EngineCounters, EngineStats
from onnx_chunk.sampling import Sampler

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
# The engine thread leaves after this long with nothing to do (the next submit starts one).
_IDLE_EXIT_S = 1.0


@dataclass(frozen=True)
class EngineContext:
    """What the batch engine uses of its runtime: the runner and what its slots are made of.

    `take_number` / `give_number`: graph slot numbers for the engine's buffers;
    `release_graphs(number)`: drop the bindings and CUDA graphs held under a number.
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
    speculation: Speculation | None = None


@dataclass
class _Row:
    """A request in a slot: its length, its sampler, the prefill chunks still to run."""

    request: Request
    slot: SequenceSlot
    length: LogicalLength
    sampler: Sampler
    order: int
    chunks: collections.deque = field(default_factory=collections.deque)
    token: int = 0
    drafter: Drafter | None = None


class BatchEngine:
    """The engine of one runtime (see the module docstring)."""

    def __init__(self, context: EngineContext, slots: int,
                 max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        self._context = context
        ports, device, capacity = context.ports, context.device, context.capacity
        self.slots = slots
        self.budget = context.chunk_size
        buffers = BatchBuffers(ports.kv, ports.state, device, slots)
        self._slots = [new_slot(ports, capacity, device, context.masks, context.take_number(),
                                buffers=buffers.slot(index), captures=False)
                       for index in range(slots)]
        # The batched decode's slot: every row of the buffers, a [slots, capacity] mask.
        self._batch = SequenceSlot(context.take_number(), buffers,
                                   context.masks(slots, capacity, ports.mask_dtype, device))
        # The length an idle free row runs at (never advanced).
        self._free_length = LogicalLength(capacity)
        self._rows: list[_Row | None] = [None] * slots
        self._queue: RequestQueue[Request] = RequestQueue(max_queue)
        self._samplers: dict[int, Sampler] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._admitted = 0
        self._counters = EngineCounters()
        self._last_decode: float | None = None

    def submit(self, prompt: np.ndarray, max_new_tokens: int, eos_token_ids: tuple[int, ...],
               sampler: Sampler, *, wait: bool = False) -> Request:
        """Queue a checked request; QueueFullError when the queue is full (unless `wait`:
        then wait for room)."""
        request = Request(prompt, max_new_tokens, eos_token_ids, self.cancel)
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._closed or not self._queue.full)
            if self._closed:
                raise ClosedError("the runtime was closed; load the model again to submit")
            self._queue.push(request)
            self._samplers[request.id] = sampler
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="onnx-chunk-engine",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """End `request` now; its slot (or its place in the queue) is freed at once."""
        with self._cond:
            if not request.finish("cancelled"):
                return
            self._counters.cancelled += 1
            if self._queue.remove(request):
                del self._samplers[request.id]
            self._cond.notify_all()

    @property
    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(slots=self.slots,
                               running=sum(row is not None for row in self._rows),
                               queued=len(self._queue), queue_limit=self._queue.limit,
                               **dataclasses.asdict(self._counters))

    def close(self) -> None:
        """Stop the thread; queued and running requests fail with ClosedError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        error = ClosedError("the runtime was closed before this request finished")
        with self._cond:
            for request in self._queue.drain():
                self._fail(request, error)
            self._samplers.clear()
            for index, row in enumerate(self._rows):
                if row is not None:
                    self._fail(row.request, error)
                    self._rows[index] = None
        for slot in (*self._slots, self._batch):
            self._context.give_number(slot.number)

    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as error:  # a defect outside any step: never leave requests hanging
            logger.exception("the engine thread stopped")
            with self._cond:
                self._thread = None
                for row in self._rows:
                    if row is not None:
                        self._fail(row.request, error)
                for request in self._queue.drain():
                    self._fail(request, error)
            raise

    def _turn(self) -> bool:
        """One step, or one wait for work; False when the thread is to leave."""
        with self._cond:
            self._settle()
            if self._closed:
                self._thread = None
                return False
            if not any(self._rows):
                if not self._cond.wait(_IDLE_EXIT_S) and not self._queue:
                    self._thread = None
                    return False
                return True
        try:
            self._step()
        except Exception as error:  # a defect in the step itself: fail, never hang
            logger.exception("an engine step failed")
            with self._cond:
                for row in self._rows:
                    if row is not None:
                        self._fail(row.request, error)
        return True

    def _settle(self) -> None:
        """Free the slots of ended requests, then admit queued ones (the lock is held)."""
        for index, row in enumerate(self._rows):
            if row is not None and row.request.done:
                self._rows[index] = None
        free = [index for index, row in enumerate(self._rows) if row is None]
        for index in admit(free, len(self._queue)):
            request = self._queue.pop()
            sampler = self._samplers.pop(request.id)
            try:
                slot = self._slots[index]
                slot.reset()
            except Exception as error:  # this request fails alone; the slot stays free
                logger.exception("admitting request %d failed", request.id)
                self._fail(request, error)
                continue
            chunks = prefill_chunks(len(request.prompt), self._context.chunk_size)
            row = _Row(request, slot, LogicalLength(self._context.capacity), sampler,
                       self._admitted, collections.deque(chunks),
                       drafter=(None if self._context.speculation is None
                                else Drafter(request.prompt, self._context.speculation)))
            self._admitted += 1
            self._rows[index] = row
            request.admitted()
        self._cond.notify_all()

    def _step(self) -> None:
        rows = [(index, row) for index, row in enumerate(self._rows) if row is not None]
        prefilling = sorted((entry for entry in rows if entry[1].chunks),
                            key=lambda entry: entry[1].order)
        decoding_before = any(not row.chunks for _, row in rows)
        picks = prefill_picks([[end - begin for begin, end in row.chunks]
                               for _, row in prefilling], self.budget)
        ran = 0
        for (index, row), count in zip(prefilling, picks):
            for _ in range(count):
                if row.request.done:
                    break
                self._prefill_chunk(row)
                ran += 1
        decoding = [index for index, row in rows if not row.chunks and not row.request.done]
        with self._cond:
            self._counters.steps += 1
            if ran and decoding_before:
                self._counters.decode_stalls += 1
        verified = [index for index in decoding if self._verify(self._rows[index])]
        decoding = [index for index in decoding if index not in verified]
        if decoding:
            self._decode(decoding)
        elif not verified:
            self._last_decode = None

    def _prefill_chunk(self, row: _Row) -> None:
        begin, end = row.chunks.popleft()
        request = row.request
        began = time.perf_counter()
        try:
            logits = self._context.runner.run(
                row.slot, Forward([Row(request.prompt[begin:end], row.length)])).logits[0]
        except Exception as error:  # any failure of this forward fails its request alone
            row.chunks.clear()
            self._fail(request, error)
            return
        request.note_chunk()
        with self._cond:
            self._counters.prefill_chunks += 1
            self._counters.prefill_rows += end - begin
            self._counters.prefill_s += time.perf_counter() - began
        if not row.chunks:
            try:
                self._deliver(row, row.sampler.choose(logits))
            except Exception as error:  # this request's token choice failed: it fails alone
                self._fail(request, error)

    def _decode(self, decoding: list[int]) -> None:
        steps = set(decoding)
        rows = [Row(np.array([row.token if index in steps else 0]),
                    row.length if row is not None else self._free_length, index in steps)
                for index, row in enumerate(self._rows)]
        began = time.perf_counter()
        try:
            self._claim_batch()
            logits = self._context.runner.run(self._batch, Forward(rows)).logits
        except Exception as error:  # the forward failed: every row of it fails with it
            for index in decoding:
                self._fail(self._rows[index].request, error)
            return
        for index in decoding:
            row = self._rows[index]
            try:
                self._deliver(row, row.sampler.choose(logits[index]))
            except Exception as error:  # one row's token choice fails that request alone
                self._fail(row.request, error)
        now = time.perf_counter()
        with self._cond:
            self._counters.decode_steps += 1
            self._counters.decode_rows += len(decoding)
            self._counters.decode_s += now - began
            if self._last_decode is not None:
                self._counters.longest_decode_gap_s = max(
                    self._counters.longest_decode_gap_s, now - self._last_decode)
        self._last_decode = now

    def _verify(self, row: _Row) -> bool:
        """Verify the row's draft, if it has one, in a forward of its own slot (its last token
        and the draft, every row's logits): deliver the tokens the verification gives and
        rewind the rows it did not keep. False when the row has no draft this step (it runs
        in the batched decode)."""
        if row.drafter is None:
            return False
        request = row.request
        left = request.max_new_tokens - request.stats.new_tokens
        draft = row.drafter.draft(row.length.length, left - 1)
        if not len(draft):
            return False
        fed = np.concatenate([np.array([row.token], dtype=np.int64), draft])
        began = time.perf_counter()
        try:
            logits = self._context.runner.run(row.slot, Forward([Row(fed, row.length)],
                                                                "all")).logits[0]
            tokens = row.drafter.verified(row.sampler, logits, draft)
        except Exception as error:  # this row's forward or choice failed: it fails alone
            self._fail(request, error)
            return True
        delivered = 0
        for token in tokens:
            delivered += 1
            self._deliver(row, token)
            if request.done:
                break
        row.length.rewind(len(fed) - delivered)
        with self._cond:
            self._counters.verify_forwards += 1
            self._counters.draft_tokens += len(draft)
            self._counters.accepted_tokens += accepted(tokens, draft)
            self._counters.decode_s += time.perf_counter() - began
        return True

    def _claim_batch(self) -> None:
        """Run the batched decode in this thread: the CUDA provider keeps graphs per thread, so
        those an earlier engine thread captured on the batch's bindings are dropped first."""
        thread = threading.get_ident()
        if self._batch.thread != thread:
            if self._batch.thread:
                self._context.release_graphs(self._batch.number)
            self._batch.thread = thread

    def _deliver(self, row: _Row, token: int) -> None:
        row.token = token
        if row.drafter is not None:
            row.drafter.extend((token,))
        reason = row.request.deliver(token)
        if reason is not None:
            self._finish(row.request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.finish(reason):
            with self._cond:
                self._counters.completed += 1
                self._cond.notify_all()

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.finish("error", error):
            logger.info("request %d failed: %s", request.id, error)
            with self._cond:
                self._counters.failed += 1
                self._cond.notify_all()
