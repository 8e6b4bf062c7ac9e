"""A forward's IOBinding and its inputs: every input of a binding lives in a device buffer
allocated and bound once (fixed addresses, what a CUDA graph replays), per (session, slot,
width): token and position buffers per binding, KV, state and mask per slot. A forward writes
its tokens, positions, query_seqlens, logits rows and mask in place (`write_inputs`,
`write_native`); the mask through the slot's mask policy (`attention_mask`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from onnx_chunk.graph.logits_row import ALL_ROWS, ROW_INPUT
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.caches.cuda_graphs import GraphRuns
from onnx_chunk.runtime.device.buffers import DeviceBuffer, device_zeros
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.runner.forward import Forward
from onnx_chunk.runtime.runner.native_chunks import NativePlan
from onnx_chunk.runtime.runner.padding import PaddedForward
from onnx_chunk.runtime.runner.slot import Slot
from onnx_chunk.runtime.state.ports import LOGITS_OUTPUT, ModelPorts

# Bindings that capture no graph (and their logits buffers) a slot keeps on one shape-generic
# session: the decode width and the latest prefill width. Capturing bindings are bounded by the
# graph cache, which drops a binding with its graphs.
BINDINGS_PER_SESSION = 2


@dataclass
class Binding:
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
    # The host arrays a forward's tokens and positions are staged in (unpadded forwards).
    step_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Native chunks: the query_seqlens buffer ([batch] int32) and what it holds now.
    query_lens: DeviceBuffer | None = None
    held_query_lens: np.ndarray | None = None
    # A decoder with a logits_rows input: the row indices buffer and what it holds now. Its
    # size is fixed per binding (one row, or one per batch row of a native forward), except
    # on a binding of every row, which never captures and is rebound when the count changes.
    logits_rows: DeviceBuffer | None = None
    held_rows: np.ndarray | None = None

    def write_rows(self, name: str, rows: np.ndarray, device: Device) -> None:
        """Write the logits rows when they change (a decode loop writes them once)."""
        if self.logits_rows is None:
            return
        if self.held_rows is not None and np.array_equal(self.held_rows, rows):
            return
        if self.logits_rows.shape != rows.shape:
            self.logits_rows = device_zeros(rows.shape, np.dtype(np.int64), device)
            self.io.bind_ortvalue_input(name, self.logits_rows.value)
        self.logits_rows.write(rows.astype(np.int64, copy=False))
        self.held_rows = rows.copy()

    def write_query_lens(self, lens: np.ndarray) -> None:
        """Write query_seqlens when it changes (a decode loop writes it once)."""
        if self.query_lens is None:
            return
        if self.held_query_lens is None or not np.array_equal(self.held_query_lens, lens):
            self.query_lens.write(lens.astype(np.int32, copy=False))
            self.held_query_lens = lens.copy()


def new_binding(session: ort.InferenceSession, slot: Slot, width: int, ports: ModelPorts,
                device: Device, *, selects: bool, every_row: bool,
                graphs: Callable[[], GraphRuns | None]) -> Binding:
    """A binding of `session` at `width` on `slot`'s buffers. `selects`: a row-selecting
    session (`logits_row`); `every_row`: it returns every row's logits (it never captures);
    `graphs`: the graph run options of the new binding (called once its buffers exist)."""
    batch = slot.mask.rows
    io = session.io_binding()
    output = ALL_ROWS if every_row and selects else LOGITS_OUTPUT
    # Bound first so that it is output 0; ONNX Runtime allocates it on the first run (never
    # captured), which tells the rows the model really returns, and a buffer of that shape
    # replaces it for good.
    io.bind_output(output, device.device_type, device.device_id)
    slot.buffers.bind_kv(io)
    token_shape = ((batch, width) if ports.hidden_size is None
                   else (batch, width, ports.hidden_size))
    tokens = device_zeros(token_shape, ports.token_dtype, device)
    io.bind_ortvalue_input(ports.token_input, tokens.value)
    positions = None
    if ports.position_ids is not None:
        positions = device_zeros((batch, width), np.dtype(np.int64), device)
        io.bind_ortvalue_input(ports.position_ids, positions.value)
    slot.mask.bind(io)
    row_index = None
    if selects:
        row_index = device_zeros((1,), np.dtype(np.int64), device)
        io.bind_ortvalue_input(ROW_INPUT, row_index.value)
    logits_rows = None
    if ports.logits_rows is not None:
        logits_rows = device_zeros((1,), np.dtype(np.int64), device)
        io.bind_ortvalue_input(ports.logits_rows, logits_rows.value)
    query_lens = None
    if ports.query_seqlens is not None:
        query_lens = device_zeros((batch,), np.dtype(np.int32), device)
        io.bind_ortvalue_input(ports.query_seqlens, query_lens.value)
    runs = graphs()
    keeps = width == DECODE_WIDTH or (runs is not None and not every_row)
    return Binding(io, tokens, positions, runs, keeps_logits=keeps, output=output,
                   row_index=row_index,
                   step_tokens=np.zeros(token_shape, dtype=ports.token_dtype),
                   step_positions=np.zeros((batch, width), dtype=np.int64),
                   query_lens=query_lens, logits_rows=logits_rows)


def own_logits(binding: Binding, shape: tuple[int, ...], ports: ModelPorts,
               device: Device) -> None:
    """A logits buffer of the binding's own, of the shape its first run returned (bound
    once the first run's rows are read)."""
    binding.logits = device_zeros(shape, ports.logits_dtype, device)
    if binding.logits.host is None:
        binding.row = np.empty(binding.logits.shape[-1], dtype=binding.logits.dtype)


def release_output(binding: Binding, slot: Slot, device: Device) -> None:
    """Drop the logits ONNX Runtime allocated for a run of `binding` (when it keeps none)."""
    binding.io.clear_binding_outputs()
    binding.io.bind_output(binding.output, device.device_type, device.device_id)
    slot.buffers.bind_kv(binding.io)


def write_inputs(binding: Binding, slot: Slot, forward: Forward, plan: PaddedForward | None,
                 ports: ModelPorts, device: Device, *, native: bool,
                 embedded: Callable[[np.ndarray], np.ndarray]) -> None:
    """Tokens, positions, logits row and mask of `forward`, into the binding's buffers."""
    if plan is not None:
        binding.tokens.write(plan.tokens.reshape(binding.tokens.shape))
        if binding.positions is not None:
            binding.positions.write(plan.ports[ports.position_ids])
        if binding.row_index is not None:
            binding.row_index.write(np.full(1, plan.real_rows - 1, dtype=np.int64))
        write_rows(binding, forward, plan.real_rows, ports, device)
        slot.mask.set(binding.io, forward.rows[0].length.end(plan.width))
        return
    write_rows(binding, forward, forward.width, ports, device)
    tokens, positions = binding.step_tokens, binding.step_positions
    for index, row in enumerate(forward.rows):
        tokens[index] = embedded(row.tokens)
        positions[index] = row.length.length + np.arange(len(row.tokens))
    binding.tokens.write(tokens)
    if binding.positions is not None:
        binding.positions.write(positions)
    if native:
        # One token per row: a stepping row holds length + 1 positions after it, an idle
        # row (query_seqlens 0) its length, at least 1 (the operator needs T >= 1).
        steps = np.array([row.steps for row in forward.rows], dtype=np.int32)
        binding.write_query_lens(steps)
        if len(forward.rows) == 1:
            slot.mask.set(binding.io, forward.rows[0].length.end(forward.width))
            return
        ones = np.maximum([row.length.length + int(row.steps) for row in forward.rows], 1)
        slot.mask.set_counts(binding.io, ones, int(ones.max()))  # type: ignore[attr-defined]
    elif len(forward.rows) == 1:
        slot.mask.set(binding.io, forward.rows[0].length.end(forward.width))
    else:
        slot.mask.set_rows(binding.io, [row.length.length for row in forward.rows])


def write_native(binding: Binding, slot: Slot, forward: Forward, plan: NativePlan,
                 ports: ModelPorts, device: Device) -> None:
    """Tokens, positions, query_seqlens, logits row and mask of a native plan."""
    binding.tokens.write(plan.tokens.reshape(binding.tokens.shape))
    if binding.positions is not None:
        binding.positions.write(plan.positions)
    binding.write_query_lens(plan.query_lens)
    if ports.logits_rows is not None:
        rows = (np.arange(int(plan.query_lens[0])) if forward.logits == "all"
                else plan.last_rows)
        binding.write_rows(ports.logits_rows, rows, device)
    if binding.row_index is not None:
        binding.row_index.write(np.full(1, int(plan.last_rows[0]), dtype=np.int64))
    slot.mask.set_counts(binding.io, plan.mask_ones, plan.mask_width)  # type: ignore[attr-defined]


def write_rows(binding: Binding, forward: Forward, real_rows: int, ports: ModelPorts,
               device: Device) -> None:
    """The logits rows of a forward whose rows all end at `real_rows`: every real row for
    "all", else the last real one."""
    if ports.logits_rows is None:
        return
    rows = np.arange(real_rows) if forward.logits == "all" else last_row(real_rows)
    binding.write_rows(ports.logits_rows, rows, device)


@functools.lru_cache(maxsize=64)
def last_row(real_rows: int) -> np.ndarray:
    """[real_rows - 1] as int64, made once per count: a decode step feeds [0] without an
    allocation (read-only, shared)."""
    row = np.array([real_rows - 1], dtype=np.int64)
    row.flags.writeable = False
    return row
