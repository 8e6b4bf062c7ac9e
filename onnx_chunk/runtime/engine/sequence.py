"""One sequence on a loaded decoder: chunked prefill, decode, generation, rewind.

A sequence is request state: its slot of buffers (`sequence_pool`), its logical length, its
stats, and the busy/closed rules below. `prefill`, `decode` and `rewind` are primitives on the
model runner (`model_runner`); `generate`/`stream` is one request on the batch engine over
one caller-owned slot (`batch_engine.lone_engine`): the engine's step on the sequence's own
buffers and length, stepped by the stream, so it runs the engine's prefill, verification,
decode and finish rule.
A prompt longer than the chunk width W is fed chunk by chunk (the last one at the remainder
width, `scheduler.prefill_chunks`), and only the last chunk's logits reach the host.

A sequence's buffers are a slot of the runtime's sequence pool: `close()` (or leaving a `with`
block, or the sequence being collected) gives them back, with the graphs captured on them, for
the next sequence to reuse.

A sequence is driven by one call at a time: a call (or an open stream) holds it, and a second
one while it is held raises SequenceBusyError at once, from any thread; independent sequences
may run in parallel. A stream holds the sequence until it ends, is closed or is collected.
"""

from __future__ import annotations

import contextlib
import copy
import threading
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
from onnx_chunk.runtime.engine.batch_engine import lone_engine
from onnx_chunk.runtime.engine.counters import GenerationStats, SequenceStats
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.kv_window import rewind_is_exact
from onnx_chunk.runtime.engine.plan import StepResult
from onnx_chunk.runtime.engine.request import CheckedRequest
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.runtime.engine.sequence_pool import SequencePool
from onnx_chunk.runtime.engine.speculation import Speculation
from onnx_chunk.runtime.runner.forward import Forward, LogitsRows, Row
from onnx_chunk.runtime.runner.model_runner import ModelRunner
from onnx_chunk.sampling import Sampling


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
            return self._prefill(ids, all_logits)

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
        (`Runtime.stats.eos_token_ids`). `sampling` chooses each token (default greedy: the
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
        checked = self._checked(token_ids, max_new_tokens, eos_token_id, sampling)
        release = self._hold("stream")
        steps = self._generate(checked, release)
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
        return self._checked(token_ids, max_new_tokens, None, None).prompt

    def _checked(self, token_ids: object, max_new_tokens: object, eos_token_id: object,
                 sampling: Sampling | None) -> CheckedRequest:
        """A generation request checked (`CheckedRequest.check`) against this sequence's
        room; it gives tokens only."""
        self._check_open()
        return CheckedRequest.check(
            token_ids, max_new_tokens, eos_token_id, sampling, vocab=self._vocab,
            eos_default=self._eos_token_ids, room=self._length,
            tokens_only="a sequence's generation gives tokens only; ask for logprobs "
                        "through the batch engine (Runtime.submit or generate_text)")

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

    def _generate(self, checked: CheckedRequest,
                  release: Callable[[], None]) -> Iterator[int]:
        """The generation, rolled back as a whole when a step fails; frees the sequence at the end.

        A failure (an exception in a prefill or decode step) leaves the sequence's length and
        recurrent state as they were before the call. A consumer that stops iterating early
        (GeneratorExit) keeps what was generated so far.
        """
        try:
            with self._all_or_nothing():
                yield from self._steps(checked)
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

    def _steps(self, checked: CheckedRequest) -> Iterator[int]:
        """One request on a lone engine over this sequence's slot and length, stepped
        here until it ends; each token yielded as the step delivered it. The decode variant is
        pinned from the first token to the end (it cannot be evicted meanwhile)."""
        generation = GenerationStats(prompt_tokens=len(checked.prompt))
        self._stats.last_generation = generation
        engine = lone_engine(self._runner, self._slot, self._length,
                             chunk_size=self._chunk_size, speculation=self._speculation)
        request = engine.submit(checked)
        with contextlib.ExitStack() as pinned:
            pinned.callback(engine.release)
            while True:
                # A sequence closed between two tokens: its stream raises ClosedError here; the
                # buffers go back to the pool once the stream lets the sequence go.
                self._check_open()
                if generation.new_tokens and engine.runner.decode is None:
                    engine.runner.decode = pinned.enter_context(
                        self._runner.decoding(self._slot, self._length))
                self._count(engine.step(), generation)
                # Raises the request's error (a failed forward) once its tokens were taken.
                tokens, ended = request.since(generation.new_tokens)
                if tokens and not generation.new_tokens:
                    generation.ttft_s = request.stats.ttft_s or 0.0
                for index, token in enumerate(tokens):
                    generation.new_tokens += 1
                    try:
                        yield token
                    except GeneratorExit:
                        # The consumer stops: the verified tokens it did not take are dropped.
                        self._length.rewind(len(tokens) - 1 - index)
                        request.cancel()
                        raise
                if ended:
                    generation.stopped_by_eos = request.finish_reason == "stop"
                    return

    def _count(self, step: StepResult, generation: GenerationStats) -> None:
        """A step's forwards in the sequence's counters and its generation's stats."""
        stats = self._stats
        if step.chunks:
            generation.chunks.extend(step.chunks)
            stats.prefill_forwards += len(step.chunks)
            stats.padded_rows += sum(chunk.width - chunk.rows for chunk in step.chunks)
        if step.decode_rows or step.verifications:
            stats.decode_forwards += step.verifications + (1 if step.decode_rows else 0)
            stats.draft_tokens += step.drafted
            stats.accepted_tokens += step.accepted
            # Only the steps are timed: a stream's consumer may take its time between tokens.
            generation.decode_s += step.decode_s

    def _prefill(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        """Feed `ids` chunk by chunk (the caller rolls back on failure)."""
        rows_out: list[np.ndarray] = []
        for begin, end in prefill_chunks(len(ids), self._chunk_size):
            chunk = ids[begin:end]
            need: LogitsRows = "all" if all_logits else ("last" if end == len(ids) else "none")
            forward = self._runner.run(self._slot, Forward([Row(chunk, self._length)], need))
            self._stats.prefill_forwards += 1
            self._stats.padded_rows += forward.padded_rows
            if forward.logits is not None:
                rows_out.append(forward.logits[0])
        return np.concatenate(rows_out, axis=0) if all_logits else rows_out[-1]
