"""The batch engine: many sequences on one loaded decoder, advanced together step by step.

`Runtime.submit` queues a `Request`; a background thread (started by the first submit, left
when nothing is queued or running, stopped by `Runtime.close()`) runs steps. The engine sees
its runtime through an `EngineContext` (the model runner, ports, device, sizes, the mask
policy and graph slot numbers), never the runtime itself. A step:
1. frees the slots of requests that ended (finished, failed, cancelled), each keeping the ids
   whose KV it holds, and gives each of the queue's head requests the free slot whose kept ids
   share the longest usable prefix with its prompt (`scheduler.choose_slot`): the slot is
   rewound to that prefix and only the rest of the prompt is prefilled (prefix reuse);
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
freed, keeping nothing); the other requests go on.

What a slot keeps: its logical length (one `LogicalLength` per slot, lent to the request it
serves) and the ids fed to it, the prompt then the generated tokens up to that length
(`KeptPrefix`): copying a slot's KV rows and state rows to another slot with its kept prefix
makes that slot hold the same prefix. A free slot's row runs in the batched decode at its kept
length, so its write lands past the kept positions (and a window-sized cache's rows are
protected as any idle row's).

Choices of one prompt (`submit_choices`, OpenAI's `n`): the first is queued and prefilled like
any request; the others wait beside it. When its last prefill chunk has run, each other choice
takes a free slot, the first's KV and state rows are copied into it on the device
(`BatchBuffers.copy_slot`), and it chooses its first token from the same logits with its own
sampler; from then on every choice decodes as a request of its own. A choice that finds no
free slot, or whose first choice ended before its prefill did, is queued at the head as a
request of its own (it runs its own prefill).

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
from onnx_chunk.runtime.engine.scheduler import (
    KeptPrefix,
    PrefixRule,
    RequestQueue,
    SlotChoice,
    choose_slot,
    prefill_chunks,
    prefill_picks,
)
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.engine.speculation import Drafter, Speculation, accepted
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.runner.model_runner import Forward, ModelRunner, Row
from onnx_chunk.runtime.runner.ports import ModelPorts
from onnx_chunk.runtime.stats import EngineCounters, EngineStats
from onnx_chunk.sampling import Sampler, prompt_logprobs_of

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
# The engine thread leaves after this long with nothing to do (the next submit starts one).
_IDLE_EXIT_S = 1.0
_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class EngineContext:
    """What the batch engine uses of its runtime: the runner and what its slots are made of.

    `take_number` / `give_number`: graph slot numbers for the engine's buffers;
    `release_graphs(number)`: drop the bindings and CUDA graphs held under a number;
    `prefix_reuse`: whether a slot keeps its prefix for later requests (see the module
    docstring).
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
        self._buffers = buffers
        self._slots = [new_slot(ports, capacity, device, context.masks, context.take_number(),
                                buffers=buffers.slot(index), captures=False)
                       for index in range(slots)]
        # The batched decode's slot: every row of the buffers, a [slots, capacity] mask.
        self._batch = SequenceSlot(context.take_number(), buffers,
                                   context.masks(slots, capacity, ports.mask_dtype, device))
        # Each slot's logical length, lent to the request it serves and kept after it, with
        # the ids it holds (prefix reuse).
        self._lengths = [LogicalLength(capacity) for _ in range(slots)]
        self._kept = [KeptPrefix(_NO_IDS)] * slots
        self._rule = PrefixRule(
            windows=tuple((port.shape[2], port.window) for port in ports.kv
                          if port.window is not None),
            recurrent=bool(ports.state), enabled=context.prefix_reuse)
        self._released = 0
        self._rows: list[_Row | None] = [None] * slots
        self._queue: RequestQueue[Request] = RequestQueue(max_queue)
        self._samplers: dict[int, Sampler] = {}
        # The other choices of a queued or prefilling request, by its id (`submit_choices`).
        self._forks: dict[int, list[tuple[Request, Sampler]]] = {}
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

    def submit_choices(self, prompt: np.ndarray, max_new_tokens: int,
                       eos_token_ids: tuple[int, ...], samplers: list[Sampler], *,
                       wait: bool = False) -> list[Request]:
        """Queue one request per sampler on the same prompt, prefilled once (see the module
        docstring); QueueFullError as `submit` (the group takes one place in the queue)."""
        others = [(Request(prompt, max_new_tokens, eos_token_ids, self.cancel), sampler)
                  for sampler in samplers[1:]]
        with self._cond:
            first = self.submit(prompt, max_new_tokens, eos_token_ids, samplers[0], wait=wait)
            if others:
                self._forks[first.id] = others
        return [first, *(request for request, _ in others)]

    def cancel(self, request: Request) -> None:
        """End `request` now; its slot (or its place in the queue) is freed at once."""
        with self._cond:
            if not request.finish("cancelled"):
                return
            self._counters.cancelled += 1
            if self._queue.remove(request):
                del self._samplers[request.id]
                self._queue_forks(request)
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
            for others in self._forks.values():
                for request, _ in others:
                    self._fail(request, error)
            self._forks.clear()
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
                self._keep(index, row.request, row.sampler.sampling.cache_salt)
                self._queue_forks(row.request)
        free = {index: self._kept[index] for index, row in enumerate(self._rows)
                if row is None}
        while free and self._queue:
            request = self._queue.pop()
            sampler = self._samplers.pop(request.id)
            # A request for its prompt's logprobs needs every prompt row's logits: it reuses
            # no kept prefix (it still takes the slot the rule would pick otherwise).
            rule = (self._rule if sampler.sampling.prompt_logprobs is None
                    else dataclasses.replace(self._rule, enabled=False))
            choice = choose_slot(free, request.prompt, rule, sampler.sampling.cache_salt)
            del free[choice.slot]
            try:
                self._start(choice)
            except Exception as error:  # this request fails alone; the slot stays free
                logger.exception("admitting request %d failed", request.id)
                self._drop(choice.slot)
                self._fail(request, error)
                continue
            self._count_reuse(choice)
            chunks = [(begin + choice.reused, end + choice.reused) for begin, end in
                      prefill_chunks(len(request.prompt) - choice.reused,
                                     self._context.chunk_size)]
            row = _Row(request, self._slots[choice.slot], self._lengths[choice.slot], sampler,
                       self._admitted, collections.deque(chunks),
                       drafter=(None if self._context.speculation is None
                                else Drafter(request.prompt, self._context.speculation)))
            self._admitted += 1
            self._rows[choice.slot] = row
            request.admitted(choice.reused)
        self._cond.notify_all()

    def _start(self, choice: SlotChoice) -> None:
        """Rewind the chosen slot to the prefix it reuses (an empty slot: reset it)."""
        length = self._lengths[choice.slot]
        if choice.reused == 0:
            self._slots[choice.slot].reset()
        length.rewind(length.length - choice.reused)

    def _keep(self, index: int, request: Request, salt: str | None) -> None:
        """What the slot of an ended request keeps: the ids fed to it (the prompt, then the
        generated tokens, up to its length); nothing after a failure or with reuse off."""
        length = self._lengths[index].length
        fed = np.concatenate([request.prompt, np.asarray(request.produced, dtype=np.int64)])
        if (not self._rule.enabled or request.finish_reason == "error"
                or len(fed) < length):
            self._drop(index)
            return
        self._released += 1
        self._kept[index] = KeptPrefix(fed[:length], self._released, salt)

    def _drop(self, index: int) -> None:
        """The slot keeps nothing: its next request starts it empty."""
        self._kept[index] = KeptPrefix(_NO_IDS)
        self._lengths[index].rewind(self._lengths[index].length)

    def _count_reuse(self, choice: SlotChoice) -> None:
        counters = self._counters
        if choice.reused:
            counters.prefix_hits += 1
            counters.prefix_reused_tokens += choice.reused
        if choice.shared > choice.reused:
            counters.prefix_refused += 1

    def _step(self) -> None:
        rows = [(index, row) for index, row in enumerate(self._rows) if row is not None]
        prefilling = sorted((entry for entry in rows if entry[1].chunks),
                            key=lambda entry: entry[1].order)
        decoding_before = any(not row.chunks for _, row in rows)
        picks = prefill_picks([[end - begin for begin, end in row.chunks]
                               for _, row in prefilling], self.budget)
        ran = 0
        for (_, row), count in zip(prefilling, picks):
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
        top = row.sampler.sampling.prompt_logprobs
        began = time.perf_counter()
        try:
            logits = self._context.runner.run(
                row.slot, Forward([Row(request.prompt[begin:end], row.length)],
                                  "last" if top is None else "all")).logits[0]
            if top is not None:
                logits = self._prompt_logprobs(request, begin, end, logits, top)
        except Exception as error:  # any failure of this forward fails its request alone
            row.chunks.clear()
            self._fail(request, error)
            return
        request.note_chunk()
        with self._cond:
            self._counters.prefill_chunks += 1
            self._counters.prefill_rows += end - begin
            self._counters.prefill_s += time.perf_counter() - began
        if row.chunks:
            return
        for fork in self._fork(row):
            self._first_token(fork, logits)
        self._first_token(row, logits)

    def _first_token(self, row: _Row, logits: np.ndarray) -> None:
        if row.request.max_new_tokens == 0:
            self._finish(row.request, "length")  # its prompt's logprobs were all it asked for
            return
        try:
            self._deliver(row, row.sampler.choose(logits))
        except Exception as error:  # this request's token choice failed: it fails alone
            self._fail(row.request, error)

    def _fork(self, row: _Row) -> list[_Row]:
        """The other choices of `row`'s request, each in a free slot holding a device copy of
        `row`'s KV and state (those that find none are queued on their own)."""
        with self._cond:
            others = [(request, sampler) for request, sampler
                      in self._forks.pop(row.request.id, ()) if not request.done]
            source = self._rows.index(row)
            free = [index for index, held in enumerate(self._rows) if held is None]
            forks = []
            for (request, sampler), index in zip(others, free):
                slot = self._slots[index]
                try:
                    slot.reset()
                    self._buffers.copy_slot(source, index)
                except Exception as error:  # this choice fails alone; the slot stays free
                    self._drop(index)
                    self._fail(request, error)
                    continue
                # The slot's own length (the batched decode runs every slot at its length),
                # now the source's: the copy replaced what the slot kept.
                length = self._lengths[index]
                length.rewind(length.length)
                length.advance(row.length.length)
                fork = _Row(request, slot, length, sampler, self._admitted)
                self._admitted += 1
                self._rows[index] = fork
                request.admitted()
                request.add_prompt_logprobs(list(row.request.prompt_logprobs))
                forks.append(fork)
            for request, sampler in reversed(others[len(free):]):
                self._queue.push_front(request)
                self._samplers[request.id] = sampler
        return forks

    def _queue_forks(self, request: Request) -> None:
        """`request` ended before its prefill did: its other choices queue on their own (the
        lock is held)."""
        for other, sampler in reversed(self._forks.pop(request.id, ())):
            if not other.done:
                self._queue.push_front(other)
                self._samplers[other.id] = sampler

    @staticmethod
    def _prompt_logprobs(request: Request, begin: int, end: int, logits: np.ndarray,
                         top: int) -> np.ndarray:
        """Give `request` the logprobs of the prompt tokens after rows [begin, end) (each
        row's logits predict the next token); the last row's logits."""
        following = request.prompt[begin + 1:end + 1]
        entries = prompt_logprobs_of(logits[:len(following)], following, top)
        request.add_prompt_logprobs(([None] if begin == 0 else []) + entries)
        return logits[-1]

    def _decode(self, decoding: list[int]) -> None:
        steps = set(decoding)
        # A free slot's row runs at its kept length: its write lands past what it keeps.
        rows = [Row(np.array([row.token if index in steps else 0]), self._lengths[index],
                    index in steps)
                for index, row in enumerate(self._rows)]
        began = time.perf_counter()
        try:
            self._claim_batch()
            logits = self._context.runner.run(self._batch, Forward(rows)).logits
        except Exception as error:  # the forward failed: every row of it fails with it
            for index in decoding:
                self._fail(self._rows[index].request, error)
            return
        assert logits is not None  # a decode forward returns every row's last logits
        for index in decoding:
            row = self._rows[index]
            assert row is not None  # `decoding` lists busy slots only
            try:
                token = row.sampler.choose(logits[index])
                if row.drafter is not None:
                    row.drafter.observe(row.sampler, logits[index], token)
                self._deliver(row, token)
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
        reason = row.request.deliver(token, row.sampler.last)
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
