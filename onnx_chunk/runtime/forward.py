"""The forward runner: one prefill or decode forward of one sequence slot.

A prefill forward of r real rows goes through the pipeline of DESIGN.md: `plan_forward`
widens it to the ladder width (or leaves it, when padding is off) -> the variant for that width
comes from the variant pool's cache, pinned while it runs -> the forward runs with KV bound at
capacity (past and present share one buffer) -> the logits are cut to the real rows -> the
logical length becomes past + r, which rewinds any padded rows. A decode forward runs one row
on the decode variant, which its caller may keep pinned for a whole loop (`decoding`).

Only the logits rows that are needed reach the host: a prefill forward takes the logits ONNX
Runtime allocated for it, copies the wanted row (on CUDA one cudaMemcpy of that row) and lets
the rest go; the decode width and bindings that replay a CUDA graph (fixed addresses) keep a
logits buffer of their own, allocated once.

Every input lives in a buffer on the runtime's device, allocated once and bound once, so its
address never changes (what a CUDA graph replays): per (session, slot, width) binding the
token and position buffers, per slot the KV and state buffers and the attention mask. A
forward writes its tokens, positions and mask (through the mask policy, `attention_mask`)
into those buffers in place. A session that captures CUDA graphs runs each binding under its
own graph ids (`cuda_graphs`); a capture run holds the process's capture gate alone, every
other forward holds it shared, and a capture that fails falls back to running that width
without a graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.buffers import DeviceBuffer, device_zeros
from onnx_chunk.runtime.cuda_graphs import CAPTURE_GATE, GraphRuns
from onnx_chunk.runtime.kv_state import LogicalLength
from onnx_chunk.runtime.logits_row import ALL_ROWS, ROW_INPUT
from onnx_chunk.runtime.padding import QueryAxisShrunk, plan_forward
from onnx_chunk.runtime.ports import LOGITS_OUTPUT, ModelPorts
from onnx_chunk.runtime.provider import Device
from onnx_chunk.runtime.sequence_pool import SequenceSlot
from onnx_chunk.runtime.variant_cache import Specialize, VariantKey, variant_key
from onnx_chunk.runtime.variant_pool import VariantPool

# Widths whose bindings (and logits buffers) a slot keeps on one shape-generic session:
# the decode width and the latest prefill width.
_BINDINGS_PER_SESSION = 2


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
    # At the decode width: the host arrays a step's token and position are staged in.
    step_tokens: np.ndarray | None = None
    step_positions: np.ndarray | None = None


class Prefilled(NamedTuple):
    """What a prefill forward gave: the logits rows asked for, its width, its padded rows."""

    logits: np.ndarray | None
    width: int
    padded_rows: int


class ForwardRunner:
    """Runs the forwards of sequence slots on a variant pool (see the module docstring)."""

    def __init__(self, variants: VariantPool, ports: ModelPorts, device: Device, *,
                 capacity: int, tiers: tuple[int, ...], specialize: Specialize,
                 embeddings: np.ndarray | None) -> None:
        self.variants = variants
        self.ports = ports
        self.device = device
        self.capacity = capacity
        self.tiers = tiers
        self.specialize = specialize
        self.embeddings = embeddings
        self.decode_key: VariantKey = variant_key(DECODE_WIDTH, tiers, specialize)

    @property
    def closed(self) -> bool:
        """Whether the variant pool was closed (no forward runs any more)."""
        return self.variants.closed

    def prefill(self, slot: SequenceSlot, length: LogicalLength, chunk: np.ndarray,
                need: str) -> Prefilled:
        """One prefill forward of `chunk`'s rows (at most the chunk width) on `slot`.

        `need`: which logits rows come back: "none", "last" or "all" (of the real rows).
        """
        past = length.length
        ports = self.ports
        extra = {}
        if ports.position_ids is not None:
            extra[ports.position_ids] = np.arange(past, past + len(chunk),
                                                  dtype=np.int64).reshape(1, -1)
        if self.embeddings is None:
            tokens = chunk.astype(ports.token_dtype, copy=False)
        else:
            tokens = np.asarray(self.embeddings[chunk], dtype=ports.token_dtype)
        forward = plan_forward(tokens, extra, past=past, tiers=self.tiers, room=length.room,
                               position_ids=ports.position_ids,
                               enabled=self.variants.padding)
        key = variant_key(forward.width, self.tiers, self.specialize)
        shrunk: QueryAxisShrunk | None = None
        # The logits are cut, read and released while the variant is still pinned, so no other
        # thread can evict it (and count its memory as freed) while its output is in use.
        with self.variants.cache.acquire(key) as session, \
                self._gate(session, slot, forward.width):
            binding = self._binding(session, slot, forward.width, all_rows=need == "all")
            binding.tokens.write(forward.tokens.reshape(binding.tokens.shape))
            if binding.positions is not None:
                binding.positions.write(forward.ports[ports.position_ids])
            if binding.row_index is not None:
                binding.row_index.write(np.full(1, forward.real_rows - 1, dtype=np.int64))
            logits = self._run_bound(key, session, binding, slot, length, forward.width)
            try:
                # cut_logits applies the shape rules (and the padding self-check) to a view
                # that holds the shape only: no logits are read here. A row-selecting session
                # returned the last real row alone.
                real_rows = (1 if binding.output == LOGITS_OUTPUT and binding.row_index is not None
                             else forward.cut_logits(_shape_only(logits)).shape[1])
            except QueryAxisShrunk as error:
                shrunk = error
            else:
                slot.buffers.swap_state()
                length.advance(forward.real_rows)
                rows = _read(logits, real_rows, forward.real_rows, need)
            finally:
                self._release_output(binding, slot)
        if shrunk is not None:
            # Rerun unpadded, with no variant pinned by this thread any more.
            self.variants.disable_padding(str(shrunk))
            return self.prefill(slot, length, chunk, need)
        return Prefilled(rows, forward.width, forward.width - forward.real_rows)

    @contextlib.contextmanager
    def decoding(self, slot: SequenceSlot,
                 length: LogicalLength) -> Iterator[Callable[[int], np.ndarray]]:
        """Pin the decode variant for the block; yields a step: token -> its logits row.

        The row is a view (or, off the host, the binding's row buffer): copy it to keep it
        past the next step. Other threads still get the rest of the cache meanwhile, and each
        step costs no cache lookup.
        """
        with self.variants.cache.acquire(self.decode_key) as session:
            binding = self._binding(session, slot, DECODE_WIDTH)
            yield functools.partial(self.decode_on, session, binding, slot, length)

    def decode_on(self, session: ort.InferenceSession, binding: _Binding, slot: SequenceSlot,
                  length: LogicalLength, token: int) -> np.ndarray:
        """One decode forward of `token` on a pinned session; its logits row."""
        with self._gate_for(slot, binding):
            if self.embeddings is None:
                binding.step_tokens[0, 0] = token
            else:
                binding.step_tokens[0, 0] = self.embeddings[token]
            binding.tokens.write(binding.step_tokens)
            if binding.positions is not None:
                binding.step_positions[0, 0] = length.length
                binding.positions.write(binding.step_positions)
            logits = self._run_bound(self.decode_key, session, binding, slot, length,
                                     DECODE_WIDTH)
            slot.buffers.swap_state()
            length.advance(1)
            return _row(logits, logits.shape[1] - 1, out=binding.row)

    def _gate(self, session: ort.InferenceSession, slot: SequenceSlot,
              width: int) -> contextlib.AbstractContextManager:
        """The capture gate as the next run of `slot` at `width` needs it.

        Alone for the run that captures a graph (CUDA's global capture mode fails on device
        work from any other thread); shared for every other forward of a runtime that may
        capture; not at all where nothing captures.
        """
        return self._gate_for(slot, self.variants.bindings(session, slot.number).get(width))

    def shared_gate(self) -> contextlib.AbstractContextManager:
        """The capture gate for a forward that never captures (the batch engine's decode):
        shared where anything in the process may capture, else nothing."""
        return self._gate_for(None, None)

    def _gate_for(self, slot: SequenceSlot | None,
                  binding: _Binding | None) -> contextlib.AbstractContextManager:
        """`_gate` for a binding already at hand (the decode loop's: no lookup per token)."""
        if binding is not None and binding.graphs is not None:
            if binding.graphs.captures_next(binding.logits is None, slot.buffers.parity):
                return CAPTURE_GATE.exclusive()
            return CAPTURE_GATE.shared()
        if self.device.cuda_graphs:
            return CAPTURE_GATE.shared()
        return contextlib.nullcontext()

    def _run_bound(self, key: VariantKey, session: ort.InferenceSession, binding: _Binding,
                   slot: SequenceSlot, length: LogicalLength, width: int) -> DeviceBuffer:
        """Set the mask and bind the state for `width` rows and run; the logits buffer."""
        slot.mask.set(binding.io, length.end(width))
        slot.buffers.bind_state(binding.io)
        if binding.logits is not None:
            self._run(session, binding, slot, width, first_run=False)
            return binding.logits
        if self.device.host_visible:
            self._run(session, binding, slot, width, first_run=True)
        else:
            # Off the host, a variant's arena and CUDA graph come with its first run: the
            # cache charges that growth to the variant (on CPU the resident set would also
            # take in this slot's KV pages, written for the first time here).
            self.variants.cache.measure_growth(
                key, session, lambda: self._run(session, binding, slot, width, first_run=True))
        if not binding.keeps_logits:
            return _output_buffer(binding.io.get_outputs()[0], self.ports.logits_dtype)
        self._adopt_logits(binding)
        return binding.logits

    def _run(self, session: ort.InferenceSession, binding: _Binding, slot: SequenceSlot,
             width: int, first_run: bool) -> None:
        """Run `binding` once, under its graph id; a capture that fails runs without a graph."""
        device = self.device
        graphs = binding.graphs
        if graphs is None:
            device.run(session, binding.io, None)
            return
        parity = slot.buffers.parity
        capture = graphs.captures_next(first_run, parity)
        try:
            device.run(session, binding.io, graphs.options(first_run, parity))
        except Exception as error:  # ORT's own exception types
            if not capture:
                raise
            self.variants.note_fallback(session, width, f"{type(error).__name__}: {error}")
            device.run(session, binding.io, graphs.options(first_run, parity))
            return
        if graphs.ran(first_run, parity):
            self.variants.note_capture(width)

    def _release_output(self, binding: _Binding, slot: SequenceSlot) -> None:
        """Drop the logits ONNX Runtime allocated for a run of `binding` (when it keeps none)."""
        if binding.keeps_logits:
            return
        device = self.device
        binding.io.clear_binding_outputs()
        binding.io.bind_output(binding.output, device.device_type, device.device_id)
        slot.buffers.bind_kv(binding.io)

    def _binding(self, session: ort.InferenceSession, slot: SequenceSlot, width: int,
                 all_rows: bool = False) -> _Binding:
        # The variant pool holds the bindings per live session and drops them when the cache
        # releases that session. A specialised session sees one width; the shape-generic one
        # keeps the last few widths it ran at. A row-selecting session asked for every row
        # gets a binding of the full logits beside, which never captures.
        selects = self.variants.selects_row(session)
        every_row = all_rows and selects
        name = (ALL_ROWS, width) if every_row else width
        bindings = self.variants.bindings(session, slot.number)
        binding = bindings.get(name)
        if binding is not None:
            bindings.move_to_end(name)
            return binding
        ports = self.ports
        device = self.device
        io = session.io_binding()
        output = ALL_ROWS if every_row else LOGITS_OUTPUT
        # Bound first so that it is output 0; ONNX Runtime allocates it on the first run (never
        # captured), which tells the rows the model really returns, and a buffer of that shape
        # replaces it for good.
        io.bind_output(output, device.device_type, device.device_id)
        slot.buffers.bind_kv(io)
        token_shape = (1, width) if ports.hidden_size is None else (1, width, ports.hidden_size)
        tokens = device_zeros(token_shape, ports.token_dtype, device)
        io.bind_ortvalue_input(ports.token_input, tokens.value)
        positions = None
        if ports.position_ids is not None:
            positions = device_zeros((1, width), np.int64, device)
            io.bind_ortvalue_input(ports.position_ids, positions.value)
        slot.mask.bind(io)
        row_index = None
        if selects:
            row_index = device_zeros((1,), np.int64, device)
            io.bind_ortvalue_input(ROW_INPUT, row_index.value)
        graphs = self.variants.graph_runs(session, slot.number,
                                          stateful=bool(slot.buffers.state_ports),
                                          capture=not every_row and slot.captures)
        keeps = width == DECODE_WIDTH or (graphs is not None and not every_row)
        binding = _Binding(io, tokens, positions, graphs, keeps_logits=keeps, output=output,
                           row_index=row_index)
        if width == DECODE_WIDTH:
            binding.step_tokens = np.zeros(token_shape, dtype=ports.token_dtype)
            binding.step_positions = np.zeros((1, 1), dtype=np.int64)
        bindings[name] = binding
        while len(bindings) > _BINDINGS_PER_SESSION:
            bindings.popitem(last=False)
        return binding

    def _adopt_logits(self, binding: _Binding) -> None:
        produced = binding.io.get_outputs()[0]
        binding.logits = device_zeros(tuple(produced.shape()), self.ports.logits_dtype,
                                      self.device)
        binding.logits.value.update_inplace(produced)
        binding.io.bind_ortvalue_output(LOGITS_OUTPUT, binding.logits.value)
        if binding.logits.host is None:
            binding.row = np.empty(binding.logits.shape[-1], dtype=binding.logits.dtype)


def _read(logits: DeviceBuffer, returned: int, real_rows: int, need: str) -> np.ndarray | None:
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


def _row(logits: DeviceBuffer, row: int, out: np.ndarray | None = None) -> np.ndarray:
    """Row `row` of a [1, rows, vocab] logits buffer, on the host (into `out` when given)."""
    vocab = logits.shape[-1]
    return logits.read(row * vocab, vocab, out)


def _output_buffer(value: ort.OrtValue, dtype: np.dtype) -> DeviceBuffer:
    """An output ONNX Runtime allocated, read through partial copies like any device buffer."""
    return DeviceBuffer(value, None, np.dtype(dtype))


def _shape_only(buffer: DeviceBuffer) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=buffer.dtype), buffer.shape)
