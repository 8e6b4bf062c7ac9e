"""One sequence on a loaded decoder: chunked prefill, decode, generation, rewind.

A forward of r real rows goes through the pipeline of DESIGN.md:
`plan_forward` widens it to the ladder width (or leaves it, when padding is off) -> the variant
for that width comes from the runtime's cache, pinned while it runs -> the forward runs with KV
bound at capacity (past and present share one buffer) -> the logits are cut to the real rows
-> the logical length becomes past + r, which rewinds any padded rows.

A prompt longer than the chunk width W is fed chunk by chunk (the last one at the remainder
width). Only the logits rows that are needed reach the host: a prefill forward takes the
logits ONNX Runtime allocated for it, copies the wanted row (on CUDA one cudaMemcpy of that row)
and lets the rest go, and intermediate chunks copy nothing; the decode width and bindings that
replay a CUDA graph (fixed addresses) keep a logits buffer of their own, allocated once.

Every input lives in a buffer on the runtime's device, allocated once and bound once, so its
address never changes (what a CUDA graph replays): per (session, width) binding the token and
position buffers, per sequence the KV and state buffers and the attention mask. A forward
writes its tokens, positions and (capacity policy) mask into those buffers in place; under the
logical policy the mask is a prefix of an all-ones buffer, bound at the width of each forward.
A session that captures CUDA graphs runs each binding under its own graph ids (`cuda_graphs`);
a capture run holds the process's capture gate alone, every other forward holds it shared, and
a capture that fails falls back to running that width without a graph.

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
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from onnx_chunk import arguments
from onnx_chunk.errors import (
    ClosedError,
    ConfigError,
    InputError,
    ModelStructureError,
    SequenceBusyError,
)
from onnx_chunk.runtime.buffers import DeviceBuffer, SequenceBuffers, device_zeros
from onnx_chunk.runtime.cuda_graphs import CAPTURE_GATE, GraphRuns
from onnx_chunk.runtime.kv_state import LogicalLength
from onnx_chunk.runtime.kv_window import rewind_is_exact
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.logits_row import ALL_ROWS, ROW_INPUT
from onnx_chunk.runtime.padding import QueryAxisShrunk, plan_forward
from onnx_chunk.runtime.ports import LOGITS_OUTPUT, MASK_INPUT
from onnx_chunk.runtime.provider import Device, MaskPolicy
from onnx_chunk.runtime.sequence_pool import SequenceSlot
from onnx_chunk.runtime.stats import ChunkRecord, GenerationStats, SequenceStats
from onnx_chunk.runtime.variant_cache import VariantKey, variant_key
from onnx_chunk.sampling import GREEDY, Sampler, Sampling

if TYPE_CHECKING:
    from onnx_chunk.runtime.engine import Runtime

logger = logging.getLogger(__name__)

# Widths whose bindings (and logits buffers) a sequence keeps on one shape-generic session:
# the decode width and the latest prefill width.
_BINDINGS_PER_SESSION = 2


def prefill_chunks(length: int, width: int) -> list[tuple[int, int]]:
    """The [begin, end) row ranges a prompt of `length` tokens is fed in, at chunk width `width`.

    Rules:
    1. Chunks of `width` rows; the last one takes the remainder.
    2. A remainder of one row after a full chunk borrows a row from it (..., width - 1, 2): a
       one-row forward runs ONNX Runtime's single-row CPU kernels, which sum in another order
       (its logits differ from the whole-prompt forward's by ~1e-6), while forwards of two or
       more rows give the whole-prompt forward's logits bit for bit.
    """
    if length < 1 or width < 1:
        raise ConfigError(f"a prefill needs at least one token and a chunk width of at least 1, "
                          f"got {length} tokens at width {width}")
    bounds = [(begin, min(begin + width, length)) for begin in range(0, length, width)]
    if width > 2 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        begin, end = bounds[-2]
        bounds[-2:] = [(begin, end - 1), (end - 1, length)]
    return bounds


@dataclass
class _Binding:
    """An IOBinding of one session at one width: every buffer bound once, at a fixed address."""

    io: ort.IOBinding
    tokens: DeviceBuffer
    positions: DeviceBuffer | None
    graphs: GraphRuns | None
    # A logits buffer of its own, bound for good: for the decode width (the hot loop) and for a
    # captured CUDA graph (fixed addresses). Other widths take ONNX Runtime's output of each
    # run and let it go once the wanted row is read, so no prefill-sized logits stay held.
    keeps_logits: bool
    # The logits output bound: "logits", or every row's ("logits_all") on a row-selecting
    # session asked for all rows.
    output: str = LOGITS_OUTPUT
    # On a row-selecting session (`logits_row`): the index of the row its logits return.
    row_index: DeviceBuffer | None = None
    logits: DeviceBuffer | None = None
    # Off the host: the host copy of one logits row, allocated with the logits buffer.
    row: np.ndarray | None = None


class Sequence:
    """An independent sequence: its own KV buffers and logical length on a shared model."""

    def __init__(self, runtime: Runtime, slot: SequenceSlot | None = None) -> None:
        """`slot`: run on these buffers (a row of the batch engine's, which keeps the slot)
        instead of a slot taken from the runtime's pool and given back at close."""
        self.runtime = runtime
        ports = runtime.ports
        self._length = LogicalLength(runtime.capacity, runtime.device.mask_policy)
        pooled = slot is None
        self._pooled = pooled
        if slot is None:
            slot = runtime.pool.take()
        self._slot_number = slot.number
        self._buffers = slot.buffers
        # The mask: capacity-wide, rewritten in place (capacity policy), or all ones, bound at
        # the width of each forward (logical policy).
        self._mask = slot.mask
        # Gives the slot back on close() or when the sequence is collected, whichever is first.
        self._finalizer = weakref.finalize(self, runtime.pool.give_back if pooled else _kept,
                                           slot)
        # A decode step's inputs, shaped as its binding's buffers.
        if ports.hidden_size is None:
            self._step_tokens = np.zeros((1, 1), dtype=ports.token_dtype)
        else:
            self._step_tokens = np.zeros((1, 1, ports.hidden_size), dtype=ports.token_dtype)
        self._step_positions = np.zeros((1, 1), dtype=np.int64)
        self._row_index = np.zeros(1, dtype=np.int64)
        self._stats = SequenceStats(length=0, capacity=runtime.capacity,
                                    kv_bytes=self._buffers.nbytes)
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
        return self._slot_number

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
            self.runtime.pool.settle()

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
        if self.runtime.closed:
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
        return self._buffers

    def prefill(self, token_ids: SequenceOf[int] | np.ndarray, *,
                all_logits: bool = False) -> np.ndarray:
        """Feed a prompt (chunk by chunk); return the last row's logits [vocab].

        With `all_logits` return every prompt row's logits [rows, vocab]. The call either
        succeeds or leaves the sequence as it was.
        """
        self._check_open()
        ids = self._token_ids(token_ids)
        self._length.check_room(len(ids), f"a prompt of {len(ids)} tokens")
        if all_logits and self.runtime.ports.last_row_logits:
            raise ModelStructureError("the decoder returns the last row's logits only, so "
                                      "all prompt rows' logits cannot be given; ask for the last")
        with self._held("prefill"), self._all_or_nothing():
            return self._prefill(ids, all_logits, records=None)

    def advance_batched(self) -> None:
        """Count one decode position that a batched forward (the batch engine's) wrote into
        this sequence's row of its buffers."""
        self._length.advance(1)
        self._stats.decode_forwards += 1

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; return its logits [vocab] (a copy)."""
        self._check_open()
        ids = self._token_ids([token])
        self._length.check_room(1, "a decode step")
        with self._held("decode"):
            return self._step(int(ids[0])).copy()

    def generate(self, token_ids: SequenceOf[int] | np.ndarray, max_new_tokens: int,
                 eos_token_id: int | SequenceOf[int] | None = None, *,
                 sampling: Sampling | None = None) -> list[int]:
        """Generation: the new tokens (stopping after an end-of-sequence id if one comes).

        `eos_token_id`: one id or a sequence of ids, each in [0, vocab); None: the runtime's
        (`Runtime.eos_token_ids`). `sampling` chooses each token (default greedy: the argmax).
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
        stop_ids = self.runtime.stop_ids(eos_token_id)
        sampler = Sampler(GREEDY if sampling is None else sampling, self.runtime.ports.vocab_size)
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
        ids = self._token_ids(token_ids)
        arguments.integer(max_new_tokens, "max_new_tokens", minimum=1)
        self._length.check_room(len(ids) + int(max_new_tokens),
                                f"a prompt of {len(ids)} tokens plus {max_new_tokens} new tokens")
        return ids

    def rewind(self, count: int) -> None:
        """Drop the last `count` positions (the next forward overwrites them).

        A decoder with recurrent state cannot go back partway (its state holds no history):
        there only rewind(0) and rewinding everything are allowed. A window-sized KV cache
        (sliding-window layers) can go back only as far as it has evicted nothing still needed
        (onnx_chunk.runtime.kv_window).
        """
        self._check_open()
        count = arguments.integer(count, "the rewind count", minimum=0, maximum=self._length.length)
        length = self._length.length
        for port in self.runtime.ports.kv:
            if (port.window is not None and count != length
                    and not rewind_is_exact(length, count, port.shape[2], port.window)):
                raise InputError(
                    f"cannot rewind {count} of {length} positions: {port.input!r} keeps a "
                    f"{port.shape[2]}-row cache for a {port.window}-position window and has "
                    "already evicted positions that the shorter sequence would read again; "
                    "rewind all positions (a fresh start) or open a new sequence")
        if self._buffers.state_ports and count not in (0, self._length.length):
            raise InputError(
                f"cannot rewind {count} of {self._length.length} positions: this decoder "
                "carries recurrent state, which cannot be rolled back partway; rewind all "
                "positions (a fresh start) or open a new sequence")
        with self._held("rewind"):
            self._length.rewind(count)
            if self._buffers.state_ports and self._length.length == 0:
                self._buffers.reset_state()

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
        snapshot = self._buffers.snapshot_state()
        try:
            yield
        except GeneratorExit:
            raise
        except BaseException:
            self._length.rewind(self._length.length - start_length)
            self._buffers.restore_state(snapshot)
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
        if max_new_tokens == 1 or token in eos_ids:
            generation.stopped_by_eos = token in eos_ids
            return
        # The decode variant is pinned for the whole loop (it cannot be evicted meanwhile, and
        # other threads still get the rest of the cache); each step then costs no cache lookup.
        runtime = self.runtime
        with runtime.cache.acquire(runtime.decode_key) as session:
            binding = self._binding(session, DECODE_WIDTH)
            for _ in range(max_new_tokens - 1):
                # A sequence closed between two tokens: its stream raises ClosedError here; the
                # buffers go back to the pool once the stream lets the sequence go.
                self._check_open()
                began = time.perf_counter()
                token = sampler.choose(self._step_on(session, binding, token))
                # Only the step is timed: a stream's consumer may take its time between tokens.
                generation.decode_s += time.perf_counter() - began
                generation.new_tokens += 1
                yield token
                if token in eos_ids:
                    break
        generation.stopped_by_eos = token in eos_ids

    def _prefill(self, ids: np.ndarray, all_logits: bool,
                 records: list[ChunkRecord] | None) -> np.ndarray:
        """Feed `ids` chunk by chunk (the caller rolls back on failure)."""
        rows_out: list[np.ndarray] = []
        for begin, end in prefill_chunks(len(ids), self.runtime.chunk_size):
            chunk = ids[begin:end]
            need = "all" if all_logits else ("last" if end == len(ids) else "none")
            began = time.perf_counter()
            logits, run_width = self._forward(chunk, need)
            if records is not None:
                records.append(ChunkRecord(len(chunk), run_width, time.perf_counter() - began))
            if logits is not None:
                rows_out.append(logits)
        return np.concatenate(rows_out, axis=0) if all_logits else rows_out[-1]

    def _forward(self, chunk: np.ndarray, need: str) -> tuple[np.ndarray | None, int]:
        """One prefill forward of `chunk`'s rows; the logits wanted and the width it ran at."""
        runtime = self.runtime
        past = self._length.length
        ports = {}
        if runtime.ports.position_ids is not None:
            ports[runtime.ports.position_ids] = np.arange(
                past, past + len(chunk), dtype=np.int64).reshape(1, -1)
        if runtime.embeddings is None:
            tokens = chunk.astype(runtime.ports.token_dtype, copy=False)
        else:
            tokens = np.asarray(runtime.embeddings[chunk], dtype=runtime.ports.token_dtype)
        forward = plan_forward(tokens, ports, past=past, tiers=runtime.tiers,
                               room=self._length.room, position_ids=runtime.ports.position_ids,
                               enabled=runtime.padding)
        key = variant_key(forward.width, runtime.tiers, runtime.specialize)
        shrunk: QueryAxisShrunk | None = None
        # The logits are cut, read and released while the variant is still pinned, so no other
        # thread can evict it (and count its memory as freed) while its output is in use.
        with runtime.cache.acquire(key) as session, self._gate(session, forward.width):
            binding = self._binding(session, forward.width, all_rows=need == "all")
            binding.tokens.write(forward.tokens.reshape(binding.tokens.shape))
            if binding.positions is not None:
                binding.positions.write(forward.ports[runtime.ports.position_ids])
            if binding.row_index is not None:
                self._row_index[0] = forward.real_rows - 1
                binding.row_index.write(self._row_index)
            logits = self._run_bound(key, session, binding, forward.width)
            try:
                # cut_logits applies the shape rules (and the padding self-check) to a view
                # that holds the shape only: no logits are read here. A row-selecting session
                # returned the last real row alone.
                real_rows = (1 if binding.output == LOGITS_OUTPUT and binding.row_index is not None
                             else forward.cut_logits(_shape_only(logits)).shape[1])
            except QueryAxisShrunk as error:
                shrunk = error
            else:
                self._buffers.swap_state()
                self._length.advance(forward.real_rows)
                self._stats.prefill_forwards += 1
                self._stats.padded_rows += forward.width - forward.real_rows
                rows = self._read(logits, real_rows, forward.real_rows, need)
            finally:
                self._release_output(binding)
        if shrunk is not None:
            # Rerun unpadded, with no variant pinned by this thread any more.
            runtime.disable_padding(str(shrunk))
            return self._forward(chunk, need)
        return rows, forward.width

    def _step(self, token: int) -> np.ndarray:
        """One decode forward on the decode variant, acquired for this step alone."""
        runtime = self.runtime
        with runtime.cache.acquire(runtime.decode_key) as session:
            return self._step_on(session, self._binding(session, DECODE_WIDTH), token)

    def _step_on(self, session: ort.InferenceSession, binding: _Binding,
                 token: int) -> np.ndarray:
        """One decode forward on a pinned session; its logits row (a view on a host device)."""
        with self._gate_for(binding):
            return self._step_inside(session, binding, token)

    def _gate(self, session: ort.InferenceSession, width: int) -> contextlib.AbstractContextManager:
        """The capture gate as the next run of this sequence at `width` needs it.

        Alone for the run that captures a graph (CUDA's global capture mode fails on device
        work from any other thread); shared for every other forward of a runtime that may
        capture; not at all where nothing captures.
        """
        return self._gate_for(self.runtime.sessions.bindings(session,
                                                             self._slot_number).get(width))

    def _gate_for(self, binding: _Binding | None) -> contextlib.AbstractContextManager:
        """`_gate` for a binding already at hand (the decode loop's: no lookup per token)."""
        if binding is not None and binding.graphs is not None:
            if binding.graphs.captures_next(binding.logits is None, self._buffers.parity):
                return CAPTURE_GATE.exclusive()
            return CAPTURE_GATE.shared()
        if self.runtime.device.cuda_graphs:
            return CAPTURE_GATE.shared()
        return contextlib.nullcontext()

    def _step_inside(self, session: ort.InferenceSession, binding: _Binding,
                     token: int) -> np.ndarray:
        runtime = self.runtime
        if runtime.embeddings is None:
            self._step_tokens[0, 0] = token
        else:
            self._step_tokens[0, 0] = runtime.embeddings[token]
        binding.tokens.write(self._step_tokens)
        if binding.positions is not None:
            self._step_positions[0, 0] = self._length.length
            binding.positions.write(self._step_positions)
        logits = self._run_bound(runtime.decode_key, session, binding, DECODE_WIDTH)
        self._buffers.swap_state()
        self._length.advance(1)
        self._stats.decode_forwards += 1
        return _row(logits, logits.shape[1] - 1, out=binding.row)

    def _run_bound(self, key: VariantKey, session: ort.InferenceSession, binding: _Binding,
                   width: int) -> DeviceBuffer:
        """Bind the mask and state for `width` rows and run; the logits buffer."""
        runtime = self.runtime
        mask = self._length.mask_for(width)
        if runtime.device.mask_policy is MaskPolicy.CAPACITY:
            self._mask.write_range(mask, *self._length.changed)
        else:
            _bind_prefix(binding.io, MASK_INPUT, self._mask, mask.shape, runtime.device)
        self._buffers.bind_state(binding.io)
        if binding.logits is not None:
            self._run(session, binding, width, first_run=False)
            return binding.logits
        if runtime.device.host_visible:
            self._run(session, binding, width, first_run=True)
        else:
            # Off the host, a variant's arena and CUDA graph come with its first run: the
            # cache charges that growth to the variant (on CPU the resident set would also
            # take in this sequence's KV pages, written for the first time here).
            runtime.cache.measure_growth(
                key, session, lambda: self._run(session, binding, width, first_run=True))
        if not binding.keeps_logits:
            return _output_buffer(binding.io.get_outputs()[0], runtime.ports.logits_dtype)
        self._adopt_logits(binding)
        return binding.logits

    def _run(self, session: ort.InferenceSession, binding: _Binding, width: int,
             first_run: bool) -> None:
        """Run `binding` once, under its graph id; a capture that fails runs without a graph."""
        device = self.runtime.device
        graphs = binding.graphs
        if graphs is None:
            device.run(session, binding.io, None)
            return
        parity = self._buffers.parity
        capture = graphs.captures_next(first_run, parity)
        try:
            device.run(session, binding.io, graphs.options(first_run, parity))
        except Exception as error:  # ORT's own exception types
            if not capture:
                raise
            self.runtime.sessions.note_fallback(session, width, f"{type(error).__name__}: "
                                                f"{error}")
            device.run(session, binding.io, graphs.options(first_run, parity))
            return
        if graphs.ran(first_run, parity):
            self.runtime.sessions.note_capture(width)

    def _release_output(self, binding: _Binding) -> None:
        """Drop the logits ONNX Runtime allocated for a run of `binding` (when it keeps none)."""
        if binding.keeps_logits:
            return
        device = self.runtime.device
        binding.io.clear_binding_outputs()
        binding.io.bind_output(binding.output, device.device_type, device.device_id)
        self._buffers.bind_kv(binding.io)

    def _binding(self, session: ort.InferenceSession, width: int,
                 all_rows: bool = False) -> _Binding:
        # The runtime holds the bindings per live session and drops them when the cache
        # releases that session. A specialised session sees one width; the shape-generic one
        # keeps the last few widths it ran at. A row-selecting session asked for every row
        # gets a binding of the full logits beside, which never captures.
        runtime = self.runtime
        selects = runtime.sessions.selects_row(session)
        every_row = all_rows and selects
        name = (ALL_ROWS, width) if every_row else width
        bindings = runtime.bindings(session, self)
        binding = bindings.get(name)
        if binding is not None:
            bindings.move_to_end(name)
            return binding
        ports = runtime.ports
        device = runtime.device
        io = session.io_binding()
        output = ALL_ROWS if every_row else LOGITS_OUTPUT
        # Bound first so that it is output 0; ONNX Runtime allocates it on the first run (never
        # captured), which tells the rows the model really returns, and a buffer of that shape
        # replaces it for good.
        io.bind_output(output, device.device_type, device.device_id)
        self._buffers.bind_kv(io)
        token_shape = (1, width) if ports.hidden_size is None else (1, width, ports.hidden_size)
        tokens = device_zeros(token_shape, ports.token_dtype, device)
        io.bind_ortvalue_input(ports.token_input, tokens.value)
        positions = None
        if ports.position_ids is not None:
            positions = device_zeros((1, width), np.int64, device)
            io.bind_ortvalue_input(ports.position_ids, positions.value)
        if device.mask_policy is MaskPolicy.CAPACITY:
            io.bind_ortvalue_input(MASK_INPUT, self._mask.value)
        row_index = None
        if selects:
            row_index = device_zeros((1,), np.int64, device)
            io.bind_ortvalue_input(ROW_INPUT, row_index.value)
        # A row of the batch engine never captures: its state buffers are the batch's, whose
        # parity the engine's decode flips, and its thread may change between steps.
        graphs = runtime.sessions.graph_runs(session, self._slot_number,
                                             stateful=bool(self._buffers.state_ports),
                                             capture=not every_row and self._pooled)
        keeps = width == DECODE_WIDTH or (graphs is not None and not every_row)
        binding = _Binding(io, tokens, positions, graphs, keeps_logits=keeps, output=output,
                           row_index=row_index)
        bindings[name] = binding
        while len(bindings) > _BINDINGS_PER_SESSION:
            bindings.popitem(last=False)
        return binding

    def _adopt_logits(self, binding: _Binding) -> None:
        produced = binding.io.get_outputs()[0]
        binding.logits = device_zeros(tuple(produced.shape()), self.runtime.ports.logits_dtype,
                                      self.runtime.device)
        binding.logits.value.update_inplace(produced)
        binding.io.bind_ortvalue_output(LOGITS_OUTPUT, binding.logits.value)
        if binding.logits.host is None:
            binding.row = np.empty(binding.logits.shape[-1], dtype=binding.logits.dtype)

    def _read(self, logits: DeviceBuffer, returned: int, real_rows: int,
              need: str) -> np.ndarray | None:
        """The rows wanted of the `returned` real-row logits: none, the last or all."""
        if need == "none":
            return None
        if need == "last":
            return np.array(_row(logits, returned - 1))
        if returned != real_rows:
            raise ModelStructureError(
                f"a forward of {real_rows} rows returned {returned} logits rows: the "
                "decoder does not return every row's logits, so ask for the last row only")
        vocab = logits.shape[-1]
        return np.array(logits.read(0, returned * vocab).reshape(returned, vocab))

    def _token_ids(self, token_ids: SequenceOf[int] | np.ndarray) -> np.ndarray:
        return checked_token_ids(token_ids, self.runtime.ports.vocab_size)


def checked_token_ids(token_ids: SequenceOf[int] | np.ndarray, vocab: int) -> np.ndarray:
    """`token_ids` as int64, checked: 1-D, not empty, integers in [0, vocab) (InputError)."""
    ids = np.asarray(token_ids)
    if ids.size == 0:
        raise InputError("the prompt is empty; pass at least one token id")
    if ids.ndim != 1:
        raise InputError(f"expected a 1-D sequence of token ids, got shape {list(ids.shape)}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"token ids must be integers, got dtype {ids.dtype}; convert them "
                         "with int() or numpy's astype(np.int64)")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise InputError(f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside "
                         f"the vocabulary [0, {vocab}); {bad.size} id(s) out of range")
    return ids.astype(np.int64, copy=False)


def _kept(slot: SequenceSlot) -> None:
    """The close of a sequence on a slot it does not own: the slot's owner keeps it."""


def _bind_prefix(io: ort.IOBinding, name: str, buffer: DeviceBuffer, shape: tuple[int, ...],
                 device: Device) -> None:
    """Bind the leading elements of `buffer` as an input of `shape` (same address, new shape)."""
    io.bind_input(name, device.device_type, device.device_id, buffer.dtype, list(shape),
                  buffer.value.data_ptr())


def _row(logits: DeviceBuffer, row: int, out: np.ndarray | None = None) -> np.ndarray:
    """Row `row` of a [1, rows, vocab] logits buffer, on the host (into `out` when given)."""
    vocab = logits.shape[-1]
    return logits.read(row * vocab, vocab, out)


def _output_buffer(value: ort.OrtValue, dtype: np.dtype) -> DeviceBuffer:
    """An output ONNX Runtime allocated, read through partial copies like any device buffer."""
    return DeviceBuffer(value, None, np.dtype(dtype))


def _shape_only(buffer: DeviceBuffer) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=buffer.dtype), buffer.shape)
