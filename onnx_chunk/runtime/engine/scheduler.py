"""The batch engine's rules, as pure functions and a queue: who waits, who runs, what runs next.

Chunked prefill interleaved with batched decode (as Sarathi-Serve and vLLM schedule it): every
step runs some prefill chunks of the prompts being admitted, under a token budget, then one
decode forward of every running sequence. A long prompt therefore enters one budget per step,
and the running decodes wait at most one budget's prefill forwards per token, never a whole
prompt.

The scheduler (`Scheduler`) owns the waiting queue, the running requests in their slots (a
slot policy, `slots`, says what a slot is made of and keeps) and the plan of each step:
`schedule()` frees the slots of ended requests, admits queued ones and returns the step's
`Plan`; `update(plan, outputs)` turns what the plan runner gave into tokens (each row's by its
request's sampler), counts the step, delivers the tokens and ends each request by the one
finish rule (`request.finish_reason`).

Rules:
1. Waiting requests form one FIFO queue of bounded length; a submit to a full queue is a
   QueueFullError, never a silent drop or a wait (`RequestQueue`).
2. A free slot takes the request at the head of the queue: first come, first served (which
   free slot: rule 5).
   Nothing is preempted: a slot is freed only by its request finishing, failing or being
   cancelled, and a request freed so gives its slot to the next one at the next step.
3. Per step, prefill chunks run in admission order while the rows they add stay within the
   budget; the first pending chunk always runs, so a chunk wider than the budget still makes
   progress; the first chunk that does not fit ends the step's prefill, and nothing later
   skips ahead of it (`prefill_picks`).
4. A prompt is fed in the chunks a lone sequence feeds it in (`prefill_chunks`).
5. Prefix reuse: the free slot whose kept ids share the longest usable prefix with the prompt
   (`prefix_reuse`, its rules).
6. With native chunks (GroupQueryAttention's query_seqlens) the chunks of one round (each
   prompt's next picked chunk) run in one forward [slots, S] over the engine's buffers (idle
   slots at query_seqlens 0, S the widest chunk's width) when that computes no more rows
   than the chunks would alone (`batch_pays`: slots * S <= the sum of their own widths);
   else one forward each. A step in which no row decodes stalls no decode, so every
   prefilling prompt's next chunk runs (`prefill_picks` with `decoding=False`).
7. A row decodes once its prompt was fed before this step (a prompt whose last chunk runs in
   a step decodes from the next, as in nano-vllm and vLLM); a decoding row with a draft
   (speculative decoding) verifies it in a forward of its own instead.
8. Tokens are chosen in this order, then delivered: each finished prompt's first token (and
   its other choices', forked into free slots), each verification's accepted drafts, each
   decode row's token. A forward that failed fails its requests first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_chunk.errors import ClosedError, ConfigError
from onnx_chunk.runtime.engine.counters import EngineCounters, EngineStats
from onnx_chunk.runtime.engine.plan import Chunk, Outputs, Plan, Running, StepResult, Verified
from onnx_chunk.runtime.engine.prefix_reuse import SlotChoice
from onnx_chunk.runtime.engine.request import FinishReason, Request
from onnx_chunk.runtime.engine.request_queue import RequestQueue
from onnx_chunk.runtime.engine.slots import SlotPolicy
from onnx_chunk.runtime.engine.speculation import Drafter, Speculation, accepted
from onnx_chunk.sampling import Sampler, TokenLogprobs

logger = logging.getLogger(__name__)


def prefill_picks(pending: Sequence[Sequence[int]], budget: int, *,
                  decoding: bool = True) -> list[int]:
    """How many of each pending prompt's next chunks run this step (rule 3; with
    `decoding=False`, no row decoding and chunks batched natively, rule 6: one each).

    `pending[i]` lists the row counts of prompt i's remaining chunks, prompts in admission
    order; the result has one count per prompt.
    """
    if budget < 1:
        raise ConfigError(f"the prefill token budget must be at least 1 row, got {budget}")
    if not decoding:
        return [1 if chunks else 0 for chunks in pending]
    picks = [0] * len(pending)
    used = 0
    for index, chunks in enumerate(pending):
        for rows in chunks:
            if used and used + rows > budget:
                return picks
            picks[index] += 1
            used += rows
    return picks


def batch_pays(widths: Sequence[int], slots: int) -> bool:
    """Whether one round's chunks, of these (padded) widths, run in one forward of `slots`
    rows (rule 6): at least two chunks, and slots * the widest no more rows than their sum."""
    return len(widths) >= 2 and slots * max(widths) <= sum(widths)


def prefill_chunks(length: int, width: int) -> list[tuple[int, int]]:
    """The [begin, end) row ranges a prompt of `length` tokens is fed in, at chunk width `width`.

    Rules:
    1. Chunks of `width` rows; the last one takes the remainder.
    2. A remainder of one row after a full chunk borrows a row from it (..., width - 1, 2): a
       one-row forward runs ONNX Runtime's one-row CPU kernels, which sum in another order.
       Forwards of several rows still differ from the whole-prompt forward where one of them
       leaves a query row alone in a block of the CPU attention (docs/row_grouping.md); exact
       mode's even widths remove those.
    """
    if length < 1 or width < 1:
        raise ConfigError(f"a prefill needs at least one token and a chunk width of at least 1, "
                          f"got {length} tokens at width {width}")
    bounds = [(begin, min(begin + width, length)) for begin in range(0, length, width)]
    if width > 2 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        begin, end = bounds[-2]
        bounds[-2:] = [(begin, end - 1), (end - 1, length)]
    return bounds


@dataclass(slots=True)
class _Tokens:
    """A row's tokens chosen this step, each with its logprobs (None unless asked for).
    `fed`: the rows its verification fed (the length is rewound past those the delivered
    tokens do not keep; 0: no verification); `ends`: the request ends so once they are
    delivered (a request of no new tokens: "length" after its prefill)."""

    row: Running
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    fed: int = 0
    ends: FinishReason | None = None


class Scheduler:
    """The queue, the slots' requests and each step's plan (see the module docstring).

    `chunk_size`: the prompt chunk width W, also the step's prefill budget; `batches_chunks`:
    a round's chunks may run in one forward (rule 6); `speculation`: decoding rows draft and
    verify (rule 7). `lock` guards the queue, the rows and the counters; `cond` waits on it.
    """

    def __init__(self, slots: SlotPolicy, *, chunk_size: int, batches_chunks: bool,
                 speculation: Speculation | None = None, max_queue: int = 256) -> None:
        self.slots = slots
        self._chunk_size = chunk_size
        self._batches_chunks = batches_chunks
        self._speculation = speculation
        self._rows: list[Running | None] = [None] * len(slots.slots)
        self._queue: RequestQueue[Request] = RequestQueue(max_queue)
        self._samplers: dict[int, Sampler] = {}
        # The other choices of a queued or prefilling request, by its id (`submit_choices`).
        self._forks: dict[int, list[tuple[Request, Sampler]]] = {}
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self._admitted = 0
        self._counters = EngineCounters()
        self._last_decode: float | None = None
        self._ended: list[Request] = []  # ended in this step (`StepResult.finished`)

    # Requests in and out.

    def add(self, request: Request, sampler: Sampler,
            others: list[tuple[Request, Sampler]] | None = None, *, wait: bool = False) -> None:
        """Queue `request` (with `others`, its other choices); QueueFullError when the queue
        is full (unless `wait`: then wait for room); ClosedError once closed."""
        with self.lock:
            if wait:
                self.cond.wait_for(lambda: self.closed or not self._queue.full)
            if self.closed:
                raise ClosedError("the runtime was closed; load the model again to submit")
            self._queue.push(request)
            self._samplers[request.id] = sampler
            if others:
                self._forks[request.id] = others
            self.cond.notify_all()

    def cancel(self, request: Request) -> None:
        """End `request` now; its slot (or its place in the queue) is freed at once."""
        with self.lock:
            if not request.finish("cancelled"):
                return
            self._counters.cancelled += 1
            if self._queue.remove(request):
                del self._samplers[request.id]
                self._queue_forks(request)
            self.cond.notify_all()

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs (the lock is held)."""
        return bool(self._queue) or any(row is not None for row in self._rows)

    @property
    def stats(self) -> EngineStats:
        with self.lock:
            return EngineStats(slots=len(self._rows),
                               running=sum(row is not None for row in self._rows),
                               queued=len(self._queue), queue_limit=self._queue.limit,
                               **dataclasses.asdict(self._counters))

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued, forked and running request with `error`, freeing their slots."""
        with self.lock:
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
            self._ended = []

    def forget(self) -> None:
        """Drop every request, ending none (their caller is done with them)."""
        with self.lock:
            self._rows = [None] * len(self._rows)
            self._queue.drain()
            self._samplers.clear()
            self._forks.clear()
            self._ended = []

    def fail_running(self, error: BaseException) -> StepResult:
        """A defect in a step: every running request fails with it (none is left hanging)."""
        logger.error("an engine step failed", exc_info=error)
        with self.lock:
            for row in self._rows:
                if row is not None:
                    self._fail(row.request, error)
        return StepResult(finished=self._take_ended())

    # Schedule.

    def schedule(self) -> Plan:
        """Free the slots of ended requests, admit queued ones, then plan the step's forwards
        (rules 3, 6, 7): the rounds of prefill chunks (taken off each prompt's chunks), the
        drafts to verify and the rows of the batched decode."""
        with self.lock:
            self._ended = []
            rows = self._settle()
        decoding: list[Running] = []
        prefilling: list[Running] = []
        for row in rows:
            if not row.request.done:
                (prefilling if row.chunks else decoding).append(row)
        plan = Plan(running=len(rows), stalls=bool(decoding and prefilling))
        if prefilling:
            prefilling.sort(key=lambda row: row.order)
            picks = prefill_picks([[end - begin for begin, end in row.chunks]
                                   for row in prefilling], self._chunk_size,
                                  decoding=bool(decoding) or not self._batches_chunks)
            taken = [[Chunk(row, *row.chunks.popleft()) for _ in range(count)]
                     for row, count in zip(prefilling, picks)]
            plan.rounds = [[chunks[round_] for chunks in taken if len(chunks) > round_]
                           for round_ in range(max(picks))]
        plan.drafts = [] if self._speculation is None else self._drafts(decoding)
        drafted = {id(row) for row, _ in plan.drafts}
        plan.decoding = [row for row in decoding if id(row) not in drafted]
        return plan

    def _settle(self) -> list[Running]:
        """Free the slots of ended requests, then admit queued ones; the running rows (the
        lock is held)."""
        for index, row in enumerate(self._rows):
            if row is not None and row.request.done:
                self._rows[index] = None
                self.slots.keep(index, row.request, row.sampler.sampling.cache_salt)
                self._queue_forks(row.request)
        if self._queue:
            self._admit()
        return [row for row in self._rows if row is not None]

    def _admit(self) -> None:
        """Give queued requests the free slots (rules 2, 5; the lock is held)."""
        free = [index for index, row in enumerate(self._rows) if row is None]
        while free and self._queue:
            request = self._queue.pop()
            sampler = self._samplers.pop(request.id)
            choice = self.slots.choose(free, request.prompt, sampler.sampling)
            free.remove(choice.slot)
            try:
                self.slots.start(choice)
            except Exception as error:  # this request fails alone; the slot stays free
                logger.exception("admitting request %d failed", request.id)
                self.slots.drop(choice.slot)
                self._fail(request, error)
                continue
            self._count_reuse(choice)
            chunks = [(begin + choice.reused, end + choice.reused) for begin, end in
                      prefill_chunks(len(request.prompt) - choice.reused, self._chunk_size)]
            self._rows[choice.slot] = Running(
                request, choice.slot, self.slots.slots[choice.slot],
                self.slots.lengths[choice.slot], sampler, self._admitted,
                collections.deque(chunks),
                drafter=(None if self._speculation is None
                         else Drafter(request.prompt, self._speculation)))
            self._admitted += 1
            request.admitted(choice.reused)
        self.cond.notify_all()

    def _count_reuse(self, choice: SlotChoice) -> None:
        counters = self._counters
        if choice.reused:
            counters.prefix_hits += 1
            counters.prefix_reused_tokens += choice.reused
        if choice.shared > choice.reused:
            counters.prefix_refused += 1

    def _drafts(self, decoding: list[Running]) -> list[tuple[Running, np.ndarray]]:
        """The decoding rows that verify a draft this step, with their drafts (rule 7)."""
        drafted = []
        for row in decoding:
            if row.drafter is None:  # another choice of a prompt: it decodes plainly
                continue
            left = row.request.max_new_tokens - row.produced
            draft = row.drafter.draft(row.length.length, left - 1)
            if len(draft):
                drafted.append((row, draft))
        return drafted

    # Update: choose the tokens, count, deliver and finish.

    def update(self, plan: Plan, outputs: Outputs) -> StepResult:
        """The one place tokens are made (rule 8): fail the rows whose forward failed, choose
        every row's tokens, count the step, deliver the tokens (each request ending by the one
        finish rule); what the step ran, and the requests that ended in it."""
        for row, error in outputs.failed:
            row.chunks.clear()
            self._fail(row.request, error)
        chosen: list[_Tokens] = []
        for prefilled in outputs.prefilled:
            chosen.extend(self._prefilled(prefilled.chunk.row, prefilled.chunk.last,
                                          prefilled.logits, prefilled.prompt_logprobs))
        kept = 0
        for verified in outputs.verified:
            given = self._verified(verified)
            kept += sum(accepted(tokens.tokens, verified.draft) for tokens in given)
            chosen.extend(given)
        for row in outputs.decoded:
            assert outputs.decode_logits is not None  # the decode forward gave every row's
            chosen.extend(self._choose(row, outputs.decode_logits[row.index], observe=True))
        self._count(plan, outputs, kept)
        for tokens in chosen:
            self._deliver(tokens)
        return StepResult(
            tuple(prefilled.record for prefilled in outputs.prefilled), len(outputs.decoded),
            len(outputs.verified), sum(len(verified.draft) for verified in outputs.verified),
            kept, outputs.decode_s + sum(verified.seconds for verified in outputs.verified),
            self._take_ended())

    def _prefilled(self, row: Running, last: bool, logits: np.ndarray | None,
                   entries: list[TokenLogprobs | None] | None) -> list[_Tokens]:
        """A prefill chunk's prompt logprobs, if asked for; after a prompt's last chunk, the
        first token of its request and of its other choices (forked into free slots)."""
        if entries is not None:
            row.request.add_prompt_logprobs(entries)
        if not last:
            return []
        assert logits is not None  # a prompt's last chunk asks for its logits
        chosen = []
        for fork in (*self._fork(row), row):
            if fork.request.max_new_tokens == 0:  # its prompt's logprobs were all it asked for
                chosen.append(_Tokens(fork, [], [], ends="length"))
            else:
                chosen.extend(self._choose(fork, logits))
        return chosen

    def _choose(self, row: Running, logits: np.ndarray, *,
                observe: bool = False) -> list[_Tokens]:
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

    def _verified(self, verified: Verified) -> list[_Tokens]:
        """The tokens a verification gives (up to and including the first that is not the
        draft's)."""
        row, draft = verified.row, verified.draft
        assert row.drafter is not None  # `_drafts` gave it a draft
        try:
            result = row.drafter.verified(row.sampler, verified.logits, draft)
        except Exception as error:  # this row's choice failed: it fails alone
            self._fail(row.request, error)
            return []
        return [_Tokens(row, result.tokens, result.logprobs, fed=len(draft) + 1)]

    def _count(self, plan: Plan, outputs: Outputs, kept: int) -> None:
        """The step and its forwards in the engine's counters; each request's chunk records."""
        for prefilled in outputs.prefilled:
            prefilled.chunk.row.request.note_chunk(prefilled.record)
        with self.lock:
            counters = self._counters
            counters.steps += 1
            counters.decode_stalls += plan.stalls
            for prefilled in outputs.prefilled:
                counters.prefill_chunks += 1
                counters.prefill_rows += prefilled.chunk.end - prefilled.chunk.begin
                counters.prefill_s += prefilled.seconds
            if outputs.verified:
                counters.verify_forwards += len(outputs.verified)
                for verified in outputs.verified:
                    counters.draft_tokens += len(verified.draft)
                    counters.decode_s += verified.seconds
                counters.accepted_tokens += kept
            if outputs.decoded:
                counters.decode_steps += 1
                counters.decode_rows += len(outputs.decoded)
                counters.decode_s += outputs.decode_s
                if self._last_decode is not None:
                    counters.longest_decode_gap_s = max(
                        counters.longest_decode_gap_s, outputs.decoded_at - self._last_decode)
        if outputs.decoded:
            self._last_decode = outputs.decoded_at
        elif not outputs.decode_ran and not plan.drafts:
            self._last_decode = None

    def _fork(self, row: Running) -> list[Running]:
        """The other choices of `row`'s request, each in a free slot holding a copy of `row`'s
        KV and state (those that find none are queued on their own)."""
        with self.lock:
            others = [(request, sampler) for request, sampler
                      in self._forks.pop(row.request.id, ()) if not request.done]
            if not others:
                return []
            free = [index for index, held in enumerate(self._rows) if held is None]
            forks = []
            for (request, sampler), index in zip(others, free):
                try:
                    self.slots.fork(row.index, index)
                except Exception as error:  # this choice fails alone; the slot stays free
                    self.slots.drop(index)
                    self._fail(request, error)
                    continue
                fork = Running(request, index, self.slots.slots[index],
                               self.slots.lengths[index], sampler, self._admitted)
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
            with self.lock:
                self._counters.completed += 1
                self._ended.append(request)
                self.cond.notify_all()

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.finish("error", error):
            logger.info("request %d failed: %s", request.id, error)
            with self.lock:
                self._counters.failed += 1
                self._ended.append(request)
                self.cond.notify_all()

    def _take_ended(self) -> tuple[Request, ...]:
        with self.lock:
            ended, self._ended = tuple(self._ended), []
        return ended
