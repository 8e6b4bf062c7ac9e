"""The batch engine: many sequences on one loaded decoder, advanced together step by step.

`step()` is the one generation loop's body, whoever drives it: `Runtime.submit` queues a
`Request` and a background thread (started by the first submit, left when nothing is queued or
running, stopped by `Runtime.close()`) calls `step()` while there is work; `Runtime.step()`
runs one step in the caller's thread, and a step lock keeps every step, the thread's and a
caller's, one at a time. A lone sequence's `generate`/`stream` is a request on a
`SequenceEngine`: one slot over the sequence's own buffers and length, stepped by its stream
alone (no thread). The engine sees its runtime through an `EngineContext` (the model runner,
ports, device, sizes, the mask policy and graph slot numbers), never the runtime itself.

A step (`step`): settle, then schedule, run, postprocess.
1. Settle: free the slots of requests that ended (finished, failed, cancelled), each keeping
   the ids whose KV it holds, and give each of the queue's head requests the free slot whose
   kept ids share the longest usable prefix with its prompt (`scheduler.choose_slot`): the
   slot is rewound to that prefix and only the rest of the prompt is prefilled (prefix reuse).
2. Schedule (`_schedule`): the prefill chunks of the prompts being admitted, in admission
   order, under a token budget of one chunk width W (`scheduler.prefill_picks`; with native
   chunks and no row decoding, each prompt's next chunk), the drafts to verify (speculative
   decoding, `speculation`) and the rows of the batched decode: those whose prompt was fed
   before this step (a prompt whose last chunk runs in this step decodes from the next, as in
   nano-vllm and vLLM).
3. Run (`_run`): every forward of the plan through the model runner, their outputs (logits
   rows, widths, seconds) collected: each round of chunks as one one-row forward per chunk
   (on a row of the engine's buffers, with the ladder padding and variant cache of any
   sequence), or natively one forward [slots, S] where that computes no more rows
   (`scheduler.batch_pays`); each draft in a forward of its own slot; then one batched decode
   forward of every slot: each decoding row feeds its last token, every other row is run but
   left as it was (natively at query_seqlens 0, which leaves its cache untouched; else
   `idle_rows`).
4. Postprocess (`_postprocess`), in this order: choose every row's tokens by the request's
   sampler (a finished prompt's first token, and its other choices'; each verification's
   accepted drafts; each decode row's token), count the step, then deliver them, each request
   finished by the one finish rule (`request.finish_reason`).
A failure in a forward fails the requests of that forward with the exception (their slots are
freed, keeping nothing); the other requests go on. `step()` returns a `StepResult`.

What a slot keeps: its logical length (one `LogicalLength` per slot, lent to the request it
serves) and the ids fed to it, the prompt then the generated tokens up to that length
(`KeptPrefix`): copying a slot's KV rows and state rows to another slot with its kept prefix
makes that slot hold the same prefix. A free slot's row runs in the batched decode at its kept
length, so its write lands past the kept positions (and a window-sized cache's rows are
protected as any idle row's).

Choices of one prompt (`submit_choices`, OpenAI's `n`): the first is queued and prefilled like
any request; the others wait beside it. In the postprocess of the step its last prefill chunk
ran in, each other choice takes a free slot, the first's KV and state rows are copied into it
on the device (`BatchBuffers.copy_slot`), and it chooses its first token from the same logits
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

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from onnx_chunk.errors import CapacityError, ClosedError
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.engine.counters import ChunkRecord, EngineCounters, EngineStats
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.request import FinishReason, Request
from onnx_chunk.runtime.engine.scheduler import (
    KeptPrefix,
    PrefixRule,
    RequestQueue,
    SlotChoice,
    batch_pays,
    choose_slot,
    prefill_chunks,
    prefill_picks,
)
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.engine.speculation import Drafter, Speculation, accepted
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.runner.forward import Forward, LogitsRows, Row
from onnx_chunk.runtime.runner.model_runner import ModelRunner
from onnx_chunk.runtime.state.ports import ModelPorts
from onnx_chunk.sampling import Sampler, TokenLogprobs, prompt_logprobs_of

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


class StepResult(NamedTuple):
    """What one `step()` ran.

    `chunks`: its prefill forwards, one record per prompt chunk (real rows, query width,
    seconds); `decode_rows`: the rows that decoded in its batched decode forward (0: none ran);
    `verifications`: its draft verification forwards, `drafted` / `accepted` the tokens they
    verified and kept; `decode_s`: the time of its decode and verification forwards.
    """

    chunks: tuple[ChunkRecord, ...] = ()
    decode_rows: int = 0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_s: float = 0.0

    @property
    def ran(self) -> bool:
        """Whether the step ran any forward."""
        return bool(self.chunks) or self.decode_rows > 0 or self.verifications > 0


_IDLE = StepResult()


@dataclass
class _Row:
    """A request in a slot: its slot's index, its length, its sampler, the prefill chunks still
    to run, its last token and how many it produced."""

    request: Request
    index: int
    slot: SequenceSlot
    length: LogicalLength
    sampler: Sampler
    order: int
    chunks: collections.deque = field(default_factory=collections.deque)
    token: int = 0
    produced: int = 0
    drafter: Drafter | None = None


def _admission(row: _Row) -> int:
    return row.order


@dataclass(slots=True)
class _Plan:
    """One step's forwards, as scheduled: the rounds of prefill chunks (each prompt's picked
    chunks, one per round), the rows that verify a draft (with it) and the rows of the batched
    decode (their prompts fed before this step); `stalls`: rows decode and prompts prefill,
    so the decodes wait for the chunks (`EngineStats.decode_stalls`)."""

    rounds: list[list[_Row]]
    drafts: list[tuple[_Row, np.ndarray]]
    decoding: list[_Row]
    stalls: bool


@dataclass(slots=True)
class _Chunk:
    """A prefill chunk that ran: prompt rows [begin, end) of `row` at query width `width`;
    its last row's logits [vocab] (None before a prompt's last chunk unless its prompt
    logprobs were asked for); `last`: the prompt's last chunk; `prompt_logprobs`: the entries
    of the prompt tokens it predicted, when asked for (reduced from every row's logits as soon
    as the forward ran, so a step holds no chunk's [rows, vocab])."""

    row: _Row
    begin: int
    end: int
    width: int
    seconds: float
    logits: np.ndarray | None
    last: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def record(self) -> ChunkRecord:
        return ChunkRecord(self.end - self.begin, self.width, self.seconds)


@dataclass(slots=True)
class _Verification:
    """A verification forward that ran: `row` fed its last token and `draft`; every row's
    logits [len(draft) + 1, vocab]."""

    row: _Row
    draft: np.ndarray
    logits: np.ndarray
    seconds: float


@dataclass(slots=True)
class _Outputs:
    """What one step's forwards gave (`run`); `accepted` is filled by the postprocess."""

    chunks: list[_Chunk] = field(default_factory=list)
    verifications: list[_Verification] = field(default_factory=list)
    decoded: list[_Row] = field(default_factory=list)
    decode_logits: np.ndarray | tuple[np.ndarray] | None = None
    decode_s: float = 0.0
    decoded_at: float = 0.0
    accepted: int = 0

    def result(self) -> StepResult:
        if not self.chunks and not self.verifications:
            return StepResult((), len(self.decoded), 0, 0, 0, self.decode_s)
        return StepResult(
            tuple(chunk.record for chunk in self.chunks),
            len(self.decoded), len(self.verifications),
            sum(len(verification.draft) for verification in self.verifications),
            self.accepted,
            self.decode_s + sum(verification.seconds for verification in self.verifications))


@dataclass(slots=True)
class _Tokens:
    """A row's tokens chosen this step, each with its logprobs (None unless asked for).
    `fed`: the rows its verification fed (the length is rewound past those the delivered
    tokens do not keep; 0: no verification); `ends`: the request ends so once they are
    delivered (a request of no new tokens: "length" after its prefill)."""

    row: _Row
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    fed: int = 0
    ends: FinishReason | None = None


def _prompt_logprobs(prompt: np.ndarray, begin: int, end: int, logits: np.ndarray | None,
                     top: int) -> tuple[list[TokenLogprobs | None], np.ndarray]:
    """The logprobs entries of the prompt tokens after rows [begin, end) (each row's logits
    predict the next token; None for the prompt's first token), and the last row's logits."""
    assert logits is not None  # asked for every row's
    following = prompt[begin + 1:end + 1]
    entries: list[TokenLogprobs | None] = [None] if begin == 0 else []
    entries.extend(prompt_logprobs_of(logits[:len(following)], following, top))
    return entries, logits[-1]


class BatchEngine:
    """The engine of one runtime (see the module docstring).

    `threaded`: the first submit starts the background thread that steps while there is work;
    False: no thread, the caller drives every step (`step()`).
    """

    def __init__(self, context: EngineContext, slots: int,
                 max_queue: int = DEFAULT_MAX_QUEUE, *, threaded: bool = True) -> None:
        ports, device, capacity = context.ports, context.device, context.capacity
        self._context = context
        buffers = BatchBuffers(ports.kv, ports.state, device, slots)
        self._buffers: BatchBuffers | None = buffers
        # The batched decode's slot: every row of the buffers, a [slots, capacity] mask.
        batch = SequenceSlot(context.take_number(), buffers,
                             context.masks(slots, capacity, ports.mask_dtype, device))
        self._setup(
            context.runner, context.chunk_size, context.speculation,
            [new_slot(ports, capacity, device, context.masks, context.take_number(),
                      buffers=buffers.slot(index), captures=False) for index in range(slots)],
            batch, [LogicalLength(capacity) for _ in range(slots)],
            PrefixRule(windows=tuple((port.shape[2], port.window) for port in ports.kv
                                     if port.window is not None),
                       recurrent=bool(ports.state), enabled=context.prefix_reuse,
                       exact=context.exact),
            max_queue, threaded)

    def _setup(self, runner: ModelRunner, chunk_size: int, speculation: Speculation | None,
               slots: list[SequenceSlot], batch: SequenceSlot, lengths: list[LogicalLength],
               rule: PrefixRule, max_queue: int, threaded: bool) -> None:
        """The state every engine has: its slots, their lengths, the queue, the locks."""
        self._threaded = threaded
        self._runner = runner
        self._chunk_size = chunk_size
        self._speculation = speculation
        self.slots = len(slots)
        self.budget = chunk_size
        self._slots = slots
        self._batch = batch
        # Each slot's logical length, lent to the request it serves and kept after it, with
        # the ids it holds (prefix reuse).
        self._lengths = lengths
        self._kept = [KeptPrefix(_NO_IDS)] * len(slots)
        self._rule = rule
        self._released = 0
        self._rows: list[_Row | None] = [None] * len(slots)
        self._queue: RequestQueue[Request] = RequestQueue(max_queue)
        self._samplers: dict[int, Sampler] = {}
        # The other choices of a queued or prefilling request, by its id (`submit_choices`).
        self._forks: dict[int, list[tuple[Request, Sampler]]] = {}
        # The lock guards the rows, the queue and the counters; the condition waits on it.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Held for a whole step: the thread's steps and a caller's run one at a time.
        self._stepping = threading.RLock()
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
        with self._lock:
            if wait:
                self._cond.wait_for(lambda: self._closed or not self._queue.full)
            if self._closed:
                raise ClosedError("the runtime was closed; load the model again to submit")
            self._queue.push(request)
            self._samplers[request.id] = sampler
            if self._threaded and self._thread is None:
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
        with self._lock:
            first = self.submit(prompt, max_new_tokens, eos_token_ids, samplers[0], wait=wait)
            if others:
                self._forks[first.id] = others
        return [first, *(request for request, _ in others)]

    def cancel(self, request: Request) -> None:
        """End `request` now; its slot (or its place in the queue) is freed at once."""
        with self._lock:
            if not request.finish("cancelled"):
                return
            self._counters.cancelled += 1
            if self._queue.remove(request):
                del self._samplers[request.id]
                self._queue_forks(request)
            self._cond.notify_all()

    @property
    def batch_number(self) -> int:
        """The slot number of the batched decode's buffers (its bindings and graphs hang off
        it, as a sequence's off its slot)."""
        return self._batch.number

    @property
    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(slots=self.slots,
                               running=sum(row is not None for row in self._rows),
                               queued=len(self._queue), queue_limit=self._queue.limit,
                               **dataclasses.asdict(self._counters))

    def close(self) -> None:
        """Stop the thread; queued and running requests fail with ClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        error = ClosedError("the runtime was closed before this request finished")
        # A caller's step under way ends first (reentrant: a close from a step's callback).
        with self._stepping, self._lock:
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

    def step(self) -> StepResult:
        """One step (see the module docstring): settle the slots, then schedule this step's
        forwards, run them, postprocess their outputs (sample, deliver, finish). Callable from
        any thread: the step lock runs it between the engine thread's steps. A defect of the
        step itself (not of a forward, which fails its own requests) fails every running
        request with it."""
        with self._stepping:
            with self._lock:
                rows = self._settle()
            if not rows:
                return _IDLE
            outputs = _Outputs()
            try:
                plan = self._schedule(rows)
                self._run(plan, outputs)
                self._postprocess(plan, outputs)
            except Exception as error:  # a defect in the step itself: fail, never hang
                logger.exception("an engine step failed")
                with self._lock:
                    for held in self._rows:
                        if held is not None:
                            self._fail(held.request, error)
            return outputs.result()

    def _schedule(self, rows: list[_Row]) -> _Plan:
        """This step's forwards: the rounds of prefill chunks, the drafts to verify and the
        rows of the batched decode (those whose prompt was fed before this step; a prompt
        whose last chunk runs in it decodes from the next)."""
        decoding: list[_Row] = []
        prefilling: list[_Row] = []
        for row in rows:
            if not row.request.done:
                (prefilling if row.chunks else decoding).append(row)
        stalls = bool(decoding and prefilling)
        rounds = []
        if prefilling:
            prefilling.sort(key=_admission)
            picks = prefill_picks([[end - begin for begin, end in row.chunks]
                                   for row in prefilling], self.budget,
                                  decoding=bool(decoding) or not self._runner.batches_chunks)
            rounds = [[row for row, count in zip(prefilling, picks) if count > round_]
                      for round_ in range(max(picks))]
        drafts = [] if self._speculation is None else self._drafts(decoding)
        if drafts:
            drafted = {id(row) for row, _ in drafts}
            decoding = [row for row in decoding if id(row) not in drafted]
        return _Plan(rounds, drafts, decoding, stalls)

    def _run(self, plan: _Plan, outputs: _Outputs) -> None:
        """Every forward of `plan` through the runner, in order (the prefill rounds, the
        verifications, the batched decode), their outputs collected in `outputs`. A forward
        that fails fails its requests; a request that ended meanwhile (a failed forward, a
        cancel) is left out of the forwards after."""
        for due in plan.rounds:
            self._prefill_round([row for row in due if row.chunks and not row.request.done],
                                outputs)
        for row, draft in plan.drafts:
            if not row.request.done:
                self._verify(row, draft, outputs)
        decoding = [row for row in plan.decoding if not row.request.done]
        if decoding:
            self._decode(decoding, outputs)
        elif not plan.drafts:
            self._last_decode = None

    def _postprocess(self, plan: _Plan, outputs: _Outputs) -> None:
        """The one place tokens are made: choose every row's tokens (each finished prefill's
        first token, its other choices' too; each verification's; each decode row's), count
        the step and its forwards, then deliver the tokens, each request ending by the one
        finish rule (`request.finish_reason`)."""
        chosen: list[_Tokens] = []
        for chunk in outputs.chunks:
            chosen.extend(self._prefilled(chunk))
        for verification in outputs.verifications:
            chosen.extend(self._verified(verification, outputs))
        for row in outputs.decoded:
            assert outputs.decode_logits is not None  # the decode forward gave every row's
            chosen.extend(self._choose(row, outputs.decode_logits[row.index], observe=True))
        self._count(plan, outputs)
        for tokens in chosen:
            self._deliver(tokens)

    def _loop(self) -> None:
        try:
            while self._work():
                self.step()
        except BaseException as error:  # a defect outside any step: never leave requests hanging
            logger.exception("the engine thread stopped")
            with self._lock:
                self._thread = None
                for row in self._rows:
                    if row is not None:
                        self._fail(row.request, error)
                for request in self._queue.drain():
                    self._fail(request, error)
            raise

    def _work(self) -> bool:
        """Wait for work; False when the thread is to leave (closed, or idle for
        `_IDLE_EXIT_S`)."""
        with self._lock:
            while not self._closed:
                if self._queue or any(row is not None for row in self._rows):
                    return True
                if not self._cond.wait(_IDLE_EXIT_S) and not self._queue:
                    break
            self._thread = None
            return False

    def _settle(self) -> list[_Row]:
        """Free the slots of ended requests, then admit queued ones; the running rows (the
        lock is held)."""
        for index, row in enumerate(self._rows):
            if row is not None and row.request.done:
                self._rows[index] = None
                self._keep(index, row.request, row.sampler.sampling.cache_salt)
                self._queue_forks(row.request)
        if self._queue:
            self._admit()
        return [row for row in self._rows if row is not None]

    def _admit(self) -> None:
        """Give queued requests the free slots (`scheduler.choose_slot`; the lock is held)."""
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
                      prefill_chunks(len(request.prompt) - choice.reused, self._chunk_size)]
            row = _Row(request, choice.slot, self._slots[choice.slot],
                       self._lengths[choice.slot], sampler, self._admitted,
                       collections.deque(chunks),
                       drafter=(None if self._speculation is None
                                else Drafter(request.prompt, self._speculation)))
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
        self._kept[index] = KeptPrefix(fed[:self._rule.kept(len(request.prompt), length)],
                                       self._released, salt)

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

    # Run: the plan's forwards, their outputs collected.

    def _prefill_round(self, due: list[_Row], outputs: _Outputs) -> None:
        """Each row's next chunk: natively in one batched forward where that computes no more
        rows (scheduler rule 6), else (and for a request for its prompt's logprobs, which
        needs every row's logits) one forward each."""
        batches = self._runner.batches_chunks
        alone = [row for row in due
                 if not batches or row.sampler.sampling.prompt_logprobs is not None]
        together = [row for row in due if row not in alone]
        widths = [self._runner.chunk_width(row.chunks[0][1] - row.chunks[0][0], row.length.room)
                  for row in together]
        if batch_pays(widths, self.slots):
            self._prefill_batched(together, outputs)
        else:
            alone.extend(together)
        for row in sorted(alone, key=lambda row: row.order):
            self._prefill_chunk(row, outputs)

    def _prefill_batched(self, group: list[_Row], outputs: _Outputs) -> None:
        """One forward [slots, S] over the engine's buffers: each row of `group` feeds its next
        chunk, every other slot is idle (query_seqlens 0: its cache is left as it was)."""
        chunks = {id(row): row.chunks.popleft() for row in group}
        members = {row.index: row for row in group}
        forward_rows = []
        for index in range(self.slots):
            row = members.get(index)
            if row is None:
                forward_rows.append(Row(np.array([0]), self._lengths[index], False))
            else:
                begin, end = chunks[id(row)]
                forward_rows.append(Row(row.request.prompt[begin:end], row.length))
        began = time.perf_counter()
        try:
            self._claim_batch()
            ran = self._runner.run(self._batch, Forward(forward_rows))
        except CapacityError:
            # A slot near the capacity leaves no room for the padded width: run them apart.
            for row in group:
                row.chunks.appendleft(chunks[id(row)])
                self._prefill_chunk(row, outputs)
            return
        except Exception as error:  # the forward failed: every row of it fails with it
            for row in group:
                row.chunks.clear()
                self._fail(row.request, error)
            return
        assert ran.logits is not None  # a batched chunk forward returns each row's last logits
        seconds = (time.perf_counter() - began) / len(group)
        for index, row in members.items():
            begin, end = chunks[id(row)]
            outputs.chunks.append(_Chunk(row, begin, end, ran.width, seconds, ran.logits[index],
                                         not row.chunks))

    def _prefill_chunk(self, row: _Row, outputs: _Outputs) -> None:
        """The row's next chunk in a forward of its own slot; only a prompt's last chunk (or
        a request for its prompt's logprobs: every row's) brings logits back."""
        begin, end = row.chunks.popleft()
        request = row.request
        top = row.sampler.sampling.prompt_logprobs
        need: LogitsRows = "all" if top is not None else "none" if row.chunks else "last"
        began = time.perf_counter()
        entries = None
        try:
            ran = self._runner.run(row.slot,
                                   Forward([Row(request.prompt[begin:end], row.length)], need))
            logits = None if ran.logits is None else ran.logits[0]
            if top is not None:
                entries, logits = _prompt_logprobs(request.prompt, begin, end, logits, top)
        except Exception as error:  # any failure of this forward fails its request alone
            row.chunks.clear()
            self._fail(request, error)
            return
        outputs.chunks.append(_Chunk(row, begin, end, ran.width, time.perf_counter() - began,
                                     logits, not row.chunks, entries))

    def _drafts(self, decoding: list[_Row]) -> list[tuple[_Row, np.ndarray]]:
        """The decoding rows that verify a draft this step, with their drafts (speculative
        decoding); the others run in the batched decode."""
        assert self._speculation is not None  # `_schedule` asks only with speculation on
        drafted = []
        for row in decoding:
            if row.drafter is None:  # another choice of a prompt: it decodes plainly
                continue
            left = row.request.max_new_tokens - row.produced
            draft = row.drafter.draft(row.length.length, left - 1)
            if len(draft):
                drafted.append((row, draft))
        return drafted

    def _verify(self, row: _Row, draft: np.ndarray, outputs: _Outputs) -> None:
        """Verify the row's draft in a forward of its own slot: its last token and the draft,
        every row's logits (the postprocess rewinds the rows its tokens do not keep)."""
        fed = np.concatenate([np.array([row.token], dtype=np.int64), draft])
        began = time.perf_counter()
        try:
            logits = self._runner.run(row.slot, Forward([Row(fed, row.length)], "all")).logits
        except Exception as error:  # this row's forward failed: it fails alone
            self._fail(row.request, error)
            return
        assert logits is not None  # asked for every row's
        outputs.verifications.append(
            _Verification(row, draft, logits[0], time.perf_counter() - began))

    def _decode(self, decoding: list[_Row], outputs: _Outputs) -> None:
        """One batched decode forward: each row of `decoding` feeds its last token."""
        began = time.perf_counter()
        try:
            logits = self._decode_forward(decoding)
        except Exception as error:  # the forward failed: every row of it fails with it
            for row in decoding:
                self._fail(row.request, error)
            return
        outputs.decoded_at = time.perf_counter()
        outputs.decoded = decoding
        outputs.decode_logits = logits
        outputs.decode_s = outputs.decoded_at - began

    def _decode_forward(self, decoding: list[_Row]) -> np.ndarray | tuple[np.ndarray]:
        """The batched decode's forward of every slot; each slot's logits row [vocab]."""
        steps = {row.index: row.token for row in decoding}
        # A free slot's row runs at its kept length: its write lands past what it keeps.
        rows = [Row(np.array([steps.get(index, 0)]), self._lengths[index], index in steps)
                for index in range(self.slots)]
        self._claim_batch()
        logits = self._runner.run(self._batch, Forward(rows)).logits
        assert logits is not None  # a decode forward returns every row's last logits
        return logits

    def _claim_batch(self) -> None:
        """Run the batched decode in this thread: the CUDA provider keeps graphs per thread, so
        those an earlier thread captured on the batch's bindings are dropped first."""
        thread = threading.get_ident()
        if self._batch.thread != thread:
            if self._batch.thread:
                self._context.release_graphs(self._batch.number)
            self._batch.thread = thread

    # Postprocess: choose the tokens, count, deliver and finish.

    def _prefilled(self, chunk: _Chunk) -> list[_Tokens]:
        """A prefill chunk's prompt logprobs, if asked for; after a prompt's last chunk, the
        first token of its request and of its other choices (forked into free slots)."""
        row = chunk.row
        if chunk.prompt_logprobs is not None:
            row.request.add_prompt_logprobs(chunk.prompt_logprobs)
        if not chunk.last:
            return []
        assert chunk.logits is not None  # a prompt's last chunk asks for its logits
        chosen = []
        for fork in (*self._fork(row), row):
            if fork.request.max_new_tokens == 0:  # its prompt's logprobs were all it asked for
                chosen.append(_Tokens(fork, [], [], ends="length"))
            else:
                chosen.extend(self._choose(fork, chunk.logits))
        return chosen

    def _choose(self, row: _Row, logits: np.ndarray, *, observe: bool = False) -> list[_Tokens]:
        """The row's next token from its logits row [vocab], by its sampler (`observe`: its
        drafter learns from the choice)."""
        try:
            token = row.sampler.choose(logits)
            if observe and row.drafter is not None:
                row.drafter.observe(row.sampler, logits, token)
        except Exception as error:  # one row's token choice fails that request alone
            self._fail(row.request, error)
            return []
        return [_Tokens(row, [token], [row.sampler.last])]

    def _verified(self, verification: _Verification, outputs: _Outputs) -> list[_Tokens]:
        """The tokens a verification gives (up to and including the first that is not the
        draft's)."""
        row, draft = verification.row, verification.draft
        assert row.drafter is not None  # `_drafts` gave it a draft
        try:
            result = row.drafter.verified(row.sampler, verification.logits, draft)
        except Exception as error:  # this row's choice failed: it fails alone
            self._fail(row.request, error)
            return []
        outputs.accepted += accepted(result.tokens, draft)
        return [_Tokens(row, result.tokens, result.logprobs, fed=len(draft) + 1)]

    def _count(self, plan: _Plan, outputs: _Outputs) -> None:
        """The step and its forwards in the engine's counters; each request's chunk records."""
        for chunk in outputs.chunks:
            chunk.row.request.note_chunk(chunk.record)
        with self._lock:
            counters = self._counters
            counters.steps += 1
            counters.decode_stalls += plan.stalls
            for chunk in outputs.chunks:
                counters.prefill_chunks += 1
                counters.prefill_rows += chunk.end - chunk.begin
                counters.prefill_s += chunk.seconds
            if outputs.verifications:
                counters.verify_forwards += len(outputs.verifications)
                for verification in outputs.verifications:
                    counters.draft_tokens += len(verification.draft)
                    counters.decode_s += verification.seconds
                counters.accepted_tokens += outputs.accepted
            if outputs.decoded:
                counters.decode_steps += 1
                counters.decode_rows += len(outputs.decoded)
                counters.decode_s += outputs.decode_s
                if self._last_decode is not None:
                    counters.longest_decode_gap_s = max(
                        counters.longest_decode_gap_s, outputs.decoded_at - self._last_decode)
        if outputs.decoded:
            self._last_decode = outputs.decoded_at

    def _fork(self, row: _Row) -> list[_Row]:
        """The other choices of `row`'s request, each in a free slot holding a device copy of
        `row`'s KV and state (those that find none are queued on their own)."""
        with self._lock:
            others = [(request, sampler) for request, sampler
                      in self._forks.pop(row.request.id, ()) if not request.done]
            if not others:
                return []
            assert self._buffers is not None  # only the runtime's engine takes choices
            free = [index for index, held in enumerate(self._rows) if held is None]
            forks = []
            for (request, sampler), index in zip(others, free):
                slot = self._slots[index]
                try:
                    slot.reset()
                    self._buffers.copy_slot(row.index, index)
                except Exception as error:  # this choice fails alone; the slot stays free
                    self._drop(index)
                    self._fail(request, error)
                    continue
                # The slot's own length (the batched decode runs every slot at its length),
                # now the source's: the copy replaced what the slot kept.
                length = self._lengths[index]
                length.rewind(length.length)
                length.advance(row.length.length)
                fork = _Row(request, index, slot, length, sampler, self._admitted)
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

    def _deliver(self, chosen: _Tokens) -> None:
        """Deliver a row's chosen tokens one by one until its request ends (the one finish
        rule); a verification's rows the delivered tokens do not keep are rewound."""
        row, request = chosen.row, chosen.row.request
        delivered = 0
        for token, logprobs in zip(chosen.tokens, chosen.logprobs):
            delivered += 1
            row.token = token
            row.produced += 1
            if row.drafter is not None:
                row.drafter.extend((token,))
            reason = request.deliver(token, logprobs)
            if reason is not None:  # it ends with this token (or had ended already)
                self._finish(request, reason)
                break
        if chosen.fed:
            row.length.rewind(chosen.fed - delivered)
        if chosen.ends is not None:
            self._finish(request, chosen.ends)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.finish(reason):
            with self._lock:
                self._counters.completed += 1
                self._cond.notify_all()

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.finish("error", error):
            logger.info("request %d failed: %s", request.id, error)
            with self._lock:
                self._counters.failed += 1
                self._cond.notify_all()


class SequenceEngine(BatchEngine):
    """A lone sequence's engine: one slot over the sequence's own buffers and logical length,
    stepped by its caller alone (no thread).

    Its request continues the sequence at its length and leaves the length where it ended (no
    prefix reuse, nothing reset; the caller rolls a failed request back); its decode runs on
    `decode`, the runner's step on the pinned decode variant (`ModelRunner.decoding`), which
    the caller sets once the first token came.
    """

    def __init__(self, runner: ModelRunner, slot: SequenceSlot, length: LogicalLength, *,
                 chunk_size: int, speculation: Speculation | None) -> None:
        self._buffers = None
        self.decode: Callable[[int], np.ndarray] | None = None
        self._setup(runner, chunk_size, speculation, [slot], slot, [length],
                    PrefixRule(enabled=False), max_queue=1, threaded=False)

    def release(self) -> None:
        """Forget the request and the pinned decode once the caller is done with them. A
        request's cancel is its engine's bound method, so engine and request form a cycle that
        holds the runner (and its sessions) until the garbage collector runs; the sequence's
        resources must go when its last reference does."""
        with self._lock:
            self._rows = [None] * len(self._rows)
            self._queue.drain()
            self._samplers.clear()
            self._forks.clear()
        self.decode = None

    def _start(self, choice: SlotChoice) -> None:
        """The request continues the sequence where it is."""

    def _keep(self, index: int, request: Request, salt: str | None) -> None:
        """The slot holds what its sequence was fed; its length stays where the request left
        it."""

    def _drop(self, index: int) -> None:
        """The sequence keeps its length (its caller rolls a failure back)."""

    def _decode_forward(self, decoding: list[_Row]) -> np.ndarray | tuple[np.ndarray]:
        assert self.decode is not None  # set by the caller after the first token
        return (self.decode(decoding[0].token),)
