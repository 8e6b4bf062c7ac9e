"""One sequence on a loaded decoder: chunked prefill, decode, generation, rewind.

A sequence is request state: its slot of buffers (`sequence_pool`), its logical length, its
stats, and the busy/closed rules below; it is a thin view over the model runner
(`model_runner`), which runs each of its forwards as it runs the batch engine's, and its
generation ends by the requests' one rule (`request.finish_reason`). A prompt longer than the
chunk width W is fed chunk by chunk (the last one at the
remainder width, `scheduler.prefill_chunks`), and only the last chunk's logits reach the host.

A sequence's buffers are a slot of the runtime's sequence pool: `close()` (or leaving a `with`
block, or the sequence being collected) gives them back, with the graphs captured on them, for
the next sequence to reuse.

A sequence is driven by one call at a time: a call (or an open stream) holds it, and a second
one while it is held raises SequenceBusyError at once, from any thread; independent sequences
may run in parallel. A stream holds the sequence until it ends, is closed or is collected.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from onnx_chunk import arguments
from onnx_chunk.errors import (
    ClosedError,
    InputError,
    ModelStructureError,
    SequenceBusyError,
)
from onnx_chunk.runtime.device.buffers import SequenceBuffers
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.kv_window import rewind_is_exact
from onnx_chunk.runtime.engine.request import finish_reason
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.runtime.engine.sequence_pool import SequencePool
from onnx_chunk.runtime.engine.speculation import Drafter, Speculation, accepted
from onnx_chunk.runtime.runner.model_runner import Forward, ModelRunner, Row
from onnx_chunk.runtime.stats import ChunkRecord, GenerationStats, SequenceStats
from onnx_chunk.sampling import GREEDY, Sampler, Sampling


class Sequence:
    """An independent sequence: its own KV buffers and logical length on a shared model."""

    def __init__(self, runner: ModelRunner, slots: SequencePool, *, chunk_size: int,
                 eos_token_ids: tuple[int, ...],
                 speculation: Speculation | None = None) -> None:
        """A sequence on a slot taken from `slots` (given back at close), run by `runner`,
        feeding prompts in chunks of `chunk_size`; `eos_token_ids`: where a generation stops
        unless it names its own; `speculation`: generations draft by prompt lookup and verify
        the drafts (the caller checked that the decoder allows it)."""
        self._runner = runner
        self._speculation = speculation
        self._chunk_size = chunk_size
        self._eos_token_ids = eos_token_ids
        self._vocab = runner.ports.vocab_size
        self._length = LogicalLength(runner.capacity)
        self._slot = slot = slots.take()
        self._settle = slots.settle
        # Gives the slot back on close() or when the sequence is collected, whichever is first.
        self._finalizer = weakref.finalize(self, slots.give_back, slot)
        self._stats = SequenceStats(length=0, capacity=runner.capacity,
                                    kv_bytes=slot.buffers.nbytes)
        # Held by the call or the stream that drives the sequence (see `_hold`).
        self._busy = threading.Lock()
        # close() was called: no new work; the holder of `_busy`, if any, gives the buffers back.
        self._closing = False

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        return self._length.length

    @property
    def slot(self) -> int:
        """The number of the pooled buffer slot (and CUDA graph slot) this sequence runs on."""
        return self._slot.number

    def close(self) -> None:
        """Give the buffers (and the CUDA graphs captured on them) back to the runtime's pool.

        Idempotent; any later call on the sequence is a ClosedError. A call or stream running
        on the sequence (in another thread, or a stream not read to its end) keeps the buffers
        until it ends (a stream raises ClosedError at its next token), and they go back then,
        so no later sequence can get them while they are still written.
        """
        if not self._finalizer.alive:
            return
        self._closing = True
        if self._busy.acquire(blocking=False):
            try:
                self._give_back()
            finally:
                self._busy.release()

    def _give_back(self) -> None:
        if self._finalizer.alive:
            self._finalizer()
            self._settle()

    @property
    def closed(self) -> bool:
        """Whether the sequence was closed."""
        return self._closing or not self._finalizer.alive

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedError("this sequence was closed; open a new one with "
                              "runtime.open_sequence()")
        if self._runner.closed:
            raise ClosedError("the runtime of this sequence was closed; load the model again")

    @property
    def capacity(self) -> int:
        """The KV capacity, in positions."""
        return self._length.capacity

    @property
    def stats(self) -> SequenceStats:
        """The sequence's counters (a snapshot: later steps do not change it)."""
        return replace(self._stats, length=self._length.length,
                       last_generation=copy.deepcopy(self._stats.last_generation))

    @property
    def buffers(self) -> SequenceBuffers:
        """The device buffers (KV at capacity, recurrent state), for inspection."""
        return self._slot.buffers

    def prefill(self, token_ids: SequenceOf[int] | np.ndarray, *,
                all_logits: bool = False) -> np.ndarray:
        """Feed a prompt (chunk by chunk); return the last row's logits [vocab].

        With `all_logits` return every prompt row's logits [rows, vocab]. The call either
        succeeds or leaves the sequence as it was.
        """
        self._check_open()
        ids = arguments.prompt_ids(token_ids, self._vocab)
        self._length.check_room(len(ids), f"a prompt of {len(ids)} tokens")
        if all_logits and self._runner.ports.last_row_logits:
            raise ModelStructureError("the decoder returns the last row's logits only, so "
                                      "all prompt rows' logits cannot be given; ask for the last")
        with self._held("prefill"), self._all_or_nothing():
            return self._prefill(ids, all_logits, records=None)

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; return its logits [vocab] (a copy)."""
        self._check_open()
        ids = arguments.prompt_ids([token], self._vocab)
        self._length.check_room(1, "a decode step")
        with self._held("decode"), self._runner.decoding(self._slot, self._length) as step:
            logits = step(int(ids[0])).copy()
            self._stats.decode_forwards += 1
            return logits

    def generate(self, token_ids: SequenceOf[int] | np.ndarray, max_new_tokens: int,
                 eos_token_id: int | SequenceOf[int] | None = None, *,
                 sampling: Sampling | None = None) -> list[int]:
        """Generation: the new tokens (stopping after an end-of-sequence id if one comes).

        `eos_token_id`: one id or a sequence of ids, each in [0, vocab); None: the runtime's
        (`Runtime.options.eos_token_ids`). `sampling` chooses each token (default greedy: the
        argmax).
        The last token returned is not fed back, so the sequence then holds
        len(prompt) + len(tokens) - 1 positions more than before.
        """
        return list(self.stream(token_ids, max_new_tokens, eos_token_id, sampling=sampling))

    def stream(self, token_ids: SequenceOf[int] | np.ndarray, max_new_tokens: int,
               eos_token_id: int | SequenceOf[int] | None = None, *,
               sampling: Sampling | None = None) -> Iterator[int]:
        """Like `generate`, yielding each token as soon as it is produced.

        Every check (`check_request`, the EOS ids) runs here, before any work and before the
        first token is asked for. The stream holds the sequence until it ends, is closed or is
        collected: another call on the sequence meanwhile raises SequenceBusyError.
        """
        ids = self.check_request(token_ids, max_new_tokens)
        stop_ids = arguments.stop_ids(eos_token_id, self._eos_token_ids, self._vocab)
        if sampling is not None and (sampling.logprobs is not None
                                     or sampling.prompt_logprobs is not None):
            raise InputError("a sequence's generation gives tokens only; ask for logprobs "
                             "through the batch engine (Runtime.submit or generate_text)")
        sampler = Sampler(GREEDY if sampling is None else sampling, self._vocab)
        sampler.observe(ids)
        release = self._hold("stream")
        steps = self._generate(ids, int(max_new_tokens), stop_ids, sampler, release)
        # A stream collected before its first token never runs its own cleanup.
        weakref.finalize(steps, release)
        return steps

    def check_request(self, token_ids: SequenceOf[int] | np.ndarray,
                      max_new_tokens: int) -> np.ndarray:
        """The ids of a generation request, checked without running anything.

        Raises InputError for an empty prompt, ids outside the vocabulary or of a non-integer
        dtype, or a bad `max_new_tokens`; CapacityError when the prompt plus the new tokens do
        not fit in what is left of this sequence's capacity.
        """
        self._check_open()
        ids = arguments.prompt_ids(token_ids, self._vocab)
        arguments.integer(max_new_tokens, "max_new_tokens", minimum=1)
        self._length.check_room(len(ids) + int(max_new_tokens),
                                f"a prompt of {len(ids)} tokens plus {max_new_tokens} new tokens")
        return ids

    def rewind(self, count: int) -> None:
        """Drop the last `count` positions (the next forward overwrites them).

        A decoder with recurrent state cannot go back partway (its state holds no history):
        there only rewind(0) and rewinding everything are allowed. A window-sized KV cache
        (sliding-window layers) can go back only as far as it has evicted nothing still needed
        (onnx_chunk.runtime.engine.kv_window).
        """
        self._check_open()
        count = arguments.integer(count, "the rewind count", minimum=0, maximum=self._length.length)
        length = self._length.length
        for port in self._runner.ports.kv:
            if (port.window is not None and count != length
                    and not rewind_is_exact(length, count, port.shape[2], port.window)):
                raise InputError(
                    f"cannot rewind {count} of {length} positions: {port.input!r} keeps a "
                    f"{port.shape[2]}-row cache for a {port.window}-position window and has "
                    "already evicted positions that the shorter sequence would read again; "
                    "rewind all positions (a fresh start) or open a new sequence")
        buffers = self._slot.buffers
        if buffers.state_ports and count not in (0, self._length.length):
            raise InputError(
                f"cannot rewind {count} of {self._length.length} positions: this decoder "
                "carries recurrent state, which cannot be rolled back partway; rewind all "
                "positions (a fresh start) or open a new sequence")
        with self._held("rewind"):
            self._length.rewind(count)
            if buffers.state_ports and self._length.length == 0:
                buffers.reset_state()

    def _hold(self, what: str) -> Callable[[], None]:
        """Take the sequence for `what` (SequenceBusyError when it is taken); the release.

        The release may run more than once (a stream's end and its finalizer); only the first
        one frees the sequence.
        """
        if not self._busy.acquire(blocking=False):
            raise SequenceBusyError(
                f"this sequence is busy (another call or an open stream is using it), so it "
                f"cannot run {what} now; a sequence serves one call at a time: finish or close "
                "the stream first, or open another sequence with runtime.open_sequence()")
        released = threading.Lock()

        def release() -> None:
            if released.acquire(blocking=False):
                if self._closing:
                    self._give_back()
                self._busy.release()

        return release

    @contextmanager
    def _held(self, what: str) -> Iterator[None]:
        release = self._hold(what)
        try:
            yield
        finally:
            release()

    def _generate(self, ids: np.ndarray, max_new_tokens: int, eos_ids: tuple[int, ...],
                  sampler: Sampler, release: Callable[[], None]) -> Iterator[int]:
        """The generation, rolled back as a whole when a step fails; frees the sequence at the end.

        A failure (an exception in a prefill or decode step) leaves the sequence's length and
        recurrent state as they were before the call. A consumer that stops iterating early
        (GeneratorExit) keeps what was generated so far.
        """
        try:
            with self._all_or_nothing():
                yield from self._generate_steps(ids, max_new_tokens, eos_ids, sampler)
        finally:
            release()

    @contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """Roll the length and the recurrent state back to where they were if the block fails.

        A generator closed early (GeneratorExit) is no failure: what it produced stays.
        """
        start_length = self._length.length
        snapshot = self._slot.buffers.snapshot_state()
        try:
            yield
        except GeneratorExit:
            raise
        except BaseException:
            self._length.rewind(self._length.length - start_length)
            self._slot.buffers.restore_state(snapshot)
            raise

    def _generate_steps(self, ids: np.ndarray, max_new_tokens: int,
                        eos_ids: tuple[int, ...], sampler: Sampler) -> Iterator[int]:
        generation = GenerationStats(prompt_tokens=len(ids))
        self._stats.last_generation = generation
        start = time.perf_counter()
        token = sampler.choose(self._prefill(ids, False, generation.chunks))
        generation.ttft_s = time.perf_counter() - start
        generation.new_tokens = 1
        yield token
        reason = finish_reason(token, 1, max_new_tokens, eos_ids)
        if reason is not None:
            generation.stopped_by_eos = reason == "stop"
            return
        drafter = None
        if self._speculation is not None:
            drafter = Drafter(ids, self._speculation)
            drafter.extend((token,))
        # The decode variant is pinned for the whole loop (it cannot be evicted meanwhile).
        with self._runner.decoding(self._slot, self._length) as step:
            while reason is None:
                # A sequence closed between two tokens: its stream raises ClosedError here; the
                # buffers go back to the pool once the stream lets the sequence go.
                self._check_open()
                began = time.perf_counter()
                left = max_new_tokens - generation.new_tokens
                draft = (drafter.draft(self._length.length, left - 1) if drafter is not None
                         else ())
                if len(draft):
                    tokens = self._verified(drafter, token, draft, sampler,
                                            generation.new_tokens, max_new_tokens, eos_ids)
                else:
                    logits = step(token)
                    tokens = [sampler.choose(logits)]
                    if drafter is not None:
                        drafter.observe(sampler, logits, tokens[0])
                if drafter is not None:
                    drafter.extend(tokens)
                self._stats.decode_forwards += 1
                # Only the step is timed: a stream's consumer may take its time between tokens.
                generation.decode_s += time.perf_counter() - began
                for index, token in enumerate(tokens):
                    generation.new_tokens += 1
                    try:
                        yield token
                    except GeneratorExit:
                        # The consumer stops: the verified tokens it did not take are dropped.
                        self._length.rewind(len(tokens) - 1 - index)
                        raise
                reason = finish_reason(token, generation.new_tokens, max_new_tokens, eos_ids)
        generation.stopped_by_eos = reason == "stop"

    def _verified(self, drafter: Drafter, token: int, draft: np.ndarray, sampler: Sampler,
                  produced: int, max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
        """Feed `token` and `draft` in one forward; the tokens the verification gives, cut by
        the finish rule, with the length rewound to hold all but the last of them."""
        rows = np.concatenate([np.array([token], dtype=np.int64), draft])
        logits = self._runner.run(self._slot, Forward([Row(rows, self._length)], "all")).logits
        tokens = drafter.verified(sampler, logits[0], draft)
        self._stats.draft_tokens += len(draft)
        self._stats.accepted_tokens += accepted(tokens, draft)
        for index, chosen in enumerate(tokens):
            if finish_reason(chosen, produced + index + 1, max_new_tokens, eos_ids) is not None:
                tokens = tokens[:index + 1]
                break
        self._length.rewind(len(rows) - len(tokens))
        return tokens

    def _prefill(self, ids: np.ndarray, all_logits: bool,
                 records: list[ChunkRecord] | None) -> np.ndarray:
        """Feed `ids` chunk by chunk (the caller rolls back on failure)."""
        rows_out: list[np.ndarray] = []
        for begin, end in prefill_chunks(len(ids), self._chunk_size):
            chunk = ids[begin:end]
            need = "all" if all_logits else ("last" if end == len(ids) else "none")
            began = time.perf_counter()
            forward = self._runner.run(self._slot, Forward([Row(chunk, self._length)], need))
            self._stats.prefill_forwards += 1
            self._stats.padded_rows += forward.padded_rows
            if records is not None:
                records.append(ChunkRecord(len(chunk), forward.width,
                                           time.perf_counter() - began))
            if forward.logits is not None:
                rows_out.append(forward.logits[0])
        return np.concatenate(rows_out, axis=0) if all_logits else rows_out[-1]

