"""The model runner: every forward of a dynamic decoder, through one path for every shape.

A forward (`Forward`, in `forward`, which names the interface `ForwardRunner`) is a set of rows
over one slot's buffers (`Slot`): per batch row of the slot (one for a sequence or an engine
row's prefill, the engine's width for its batched decode) the token ids it feeds from its
logical length and whether it steps, plus which logits rows come back: "none", "last" (each
batch row's last real row) or "all" (every real row). `run` takes it through one pipeline:

1. Width: a forward of one batch row is widened to its ladder width by `plan_forward` (or left
   as it is when padding is off); a batched forward runs its rows as they are.
2. Variant: the session for that width comes from the variant cache, pinned while it runs
   (`decoding` pins the decode variant for a whole loop, so each step costs no lookup).
3. Binding (`binding`): per (session, slot, width) an IOBinding whose every input lives in a
   buffer on the runtime's device, allocated and bound once (fixed addresses, what a CUDA
   graph replays): token and position buffers per binding, KV, state and mask per slot. A
   forward writes its tokens, positions and mask (through the mask policy, `attention_mask`)
   in place.
4. Run: on a session that captures CUDA graphs, a binding at a width where capture pays (the
   decode width at any batch, the ladder tiers, a specialised session's width) runs under
   graph ids of its own from the bounded graph cache (`graph_cache`), any other under -1; a
   capture holds the process's capture gate alone, every other forward holds it shared, and a
   capture that fails falls back to running that width without a graph.
5. Idle rows of a batched forward run but are left as they were (`idle_rows`).
6. Logits (`logits`): only the rows asked for reach the host. A decoder with a `logits_rows` input
   (`convert --logits-rows`) computes only the rows it is fed: each batch row's last real
   row, or every real row of a one-row forward that asks for "all". A prefill width takes the
   logits ONNX Runtime allocated for it, copies the wanted rows and lets the rest go; the
   decode width and bindings that replay a graph keep a logits buffer of their own, allocated
   once.
7. Lengths: each stepping row's logical length advances by its real rows, which rewinds any
   padded rows. A padded forward whose logits show the padding changed the real rows'
   results switches padding off for good and runs again unpadded (the padding self-check).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.logits_row import ALL_ROWS
from onnx_chunk.ladder import DECODE_WIDTH, padded_width
from onnx_chunk.runtime.caches.cuda_graphs import CAPTURE_GATE
from onnx_chunk.runtime.caches.variant_cache import Specialize, VariantKey, variant_key
from onnx_chunk.runtime.caches.variant_pool import VariantPool
from onnx_chunk.runtime.device.buffers import DeviceBuffer
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.runner.binding import (
    BINDINGS_PER_SESSION,
    Binding,
    new_binding,
    own_logits,
    release_output,
    write_inputs,
    write_native,
)
from onnx_chunk.runtime.runner.forward import Forward, ForwardRunner, Ran, Row
from onnx_chunk.runtime.runner.idle_rows import evicting_rows
from onnx_chunk.runtime.runner.logits import output_buffer, read_native, read_rows, shape_only
from onnx_chunk.runtime.runner.native_chunks import NativePlan, NativeRow, plan_native
from onnx_chunk.runtime.runner.padding import (
    PaddedForward,
    QueryAxisShrunk,
    even_width,
    plan_forward,
)
from onnx_chunk.runtime.runner.slot import Length, Slot
from onnx_chunk.runtime.state.ports import LOGITS_OUTPUT, ModelPorts

T = TypeVar("T")


class ModelRunner:
    """Runs every forward of a dynamic decoder on a variant pool (see the module docstring)."""

    def __init__(self, variants: VariantPool, ports: ModelPorts, device: Device, *,
                 capacity: int, tiers: tuple[int, ...], specialize: Specialize,
                 embeddings: np.ndarray | None, exact: bool = False) -> None:
        self.variants = variants
        self.ports = ports
        self.device = device
        self.capacity = capacity
        self.tiers = tiers
        self.specialize = specialize
        self.embeddings = embeddings
        # Exact mode: every prompt forward of several rows runs at an even width (`even_width`).
        self.exact = exact
        self.decode_key: VariantKey = variant_key(DECODE_WIDTH, tiers, specialize)
        # Native chunks (the graph feeds GroupQueryAttention's query_seqlens): padded rows and
        # idle rows never reach the KV cache (native_chunks).
        self.native = ports.query_seqlens is not None
        self._windowed = bool(ports.kv) and all(port.window is not None for port in ports.kv)

    @property
    def batches_chunks(self) -> bool:
        """Whether a forward of several batch rows may feed several tokens per row (native
        chunks, on a decoder whose logits keep every row and a session that returns them)."""
        return self.native and not self.ports.last_row_logits and not self.variants.select_rows

    @property
    def closed(self) -> bool:
        """Whether the variant pool was closed (no forward runs any more)."""
        return self.variants.closed

    def run(self, slot: Slot, forward: Forward) -> Ran:
        """Run `forward` on `slot`'s buffers (one row per batch row of the slot)."""
        if len(forward.rows) != slot.mask.rows:
            raise ValueError(f"a forward on a slot of {slot.mask.rows} batch rows needs as many "
                             f"rows, got {len(forward.rows)}")
        several = len(forward.rows) > 1 and any(len(row.tokens) != 1 for row in forward.rows)
        if several and not self.batches_chunks:
            # The batched mask (`set_rows`) holds each row's length + 1 ones: one new token.
            raise ValueError("a batched forward feeds one token per row; several tokens per row "
                             "need native chunks (GroupQueryAttention's query_seqlens)")
        if several and forward.logits == "all":
            raise ValueError("a batched forward of several tokens per row returns each row's "
                             "last logits only; ask for \"last\" or \"none\"")
        plan: PaddedForward | NativePlan | None
        if self.native:
            plan = self._native_plan(forward)
        else:
            plan = self._plan(forward) if len(forward.rows) == 1 else None
        width = forward.width if plan is None else plan.width
        key = variant_key(width, self.tiers, self.specialize)
        shrunk: QueryAxisShrunk | None = None
        # The logits are cut, read and released while the variant is still pinned, so no other
        # thread can evict it (and count its memory as freed) while its output is in use.
        with self.variants.cache.acquire(key) as session, self._gate(session, slot, width):
            binding = self._binding(session, key, slot, width, all_rows=forward.logits == "all")
            try:
                logits = self._forward(key, session, binding, slot, forward, plan, view=False)
            except QueryAxisShrunk as error:
                shrunk = error
        if shrunk is not None:
            # Rerun unpadded, with no variant pinned by this thread any more.
            self.variants.disable_padding(str(shrunk))
            return self.run(slot, forward)
        padded = (0 if plan is None else plan.padded_rows if isinstance(plan, NativePlan)
                  else plan.width - plan.real_rows)
        return Ran(logits, width, padded)

    @contextlib.contextmanager
    def decoding(self, slot: Slot,
                 length: Length) -> Iterator[Callable[[int], np.ndarray]]:
        """Pin the decode variant for the block; yields a step: token -> its logits row.

        Each step is a one-row `Forward` of `slot` run on the pinned session, with the binding
        `run` would use. The row is a view (or, off the host, the binding's row buffer): copy
        it to keep it past the next step.
        """
        with self.variants.cache.acquire(self.decode_key) as session:
            # A new binding allocates its buffers: device work, kept out of captures.
            with self._gate_for(slot, None):
                binding = self._binding(session, self.decode_key, slot, DECODE_WIDTH)
            yield functools.partial(self._step, session, binding, slot, length)

    def _step(self, session: ort.InferenceSession, binding: Binding, slot: Slot,
              length: Length, token: int) -> np.ndarray:
        forward = Forward([Row(np.array([token]), length)])
        with self._gate_for(slot, binding):
            return self._forward(self.decode_key, session, binding, slot, forward, None,
                                 view=True)[0]

    def _plan(self, forward: Forward) -> PaddedForward | None:
        """A one-row forward of several tokens, widened up the ladder (None: one token, which
        runs at the decode width as it is)."""
        row = forward.rows[0]
        if len(row.tokens) == DECODE_WIDTH:
            return None
        ports = self.ports
        past = row.length.length
        extra = {}
        if ports.position_ids is not None:
            extra[ports.position_ids] = np.arange(past, past + len(row.tokens),
                                                  dtype=np.int64).reshape(1, -1)
        return plan_forward(self._embedded(row.tokens), extra, past=past, tiers=self.tiers,
                            room=row.length.room, position_ids=ports.position_ids,
                            enabled=self.variants.padding, even=self.exact)

    def chunk_width(self, rows: int, room: int) -> int:
        """The query width a one-row forward of `rows` tokens with `room` positions left runs
        at (its ladder tier when padding is on)."""
        padding = self.variants.padding and not (self.native and self.ports.last_row_logits)
        width = padded_width(rows, self.tiers, room) if padding else rows
        return even_width(width, room) if self.exact else width

    def _native_plan(self, forward: Forward) -> NativePlan | None:
        """A native forward's plan (None: every row feeds one token, as a decode does)."""
        if all(len(row.tokens) == DECODE_WIDTH for row in forward.rows):
            return None
        rows = [NativeRow(self._embedded(row.tokens), row.length.length, row.steps)
                for row in forward.rows]
        # A decoder that keeps only the last logits row cannot be padded: that row would be
        # a padded one.
        padding = self.variants.padding and not self.ports.last_row_logits
        return plan_native(rows, tiers=self.tiers, capacity=self.capacity,
                           windowed=self._windowed, padding=padding)

    def _embedded(self, ids: np.ndarray) -> np.ndarray:
        """The token input of `ids`: the ids, or their rows of the embedding table."""
        if self.embeddings is None:
            return np.asarray(ids).astype(self.ports.token_dtype, copy=False)
        return np.asarray(self.embeddings[ids], dtype=self.ports.token_dtype)

    def _forward(self, key: VariantKey, session: ort.InferenceSession, binding: Binding,
                 slot: Slot, forward: Forward,
                 plan: PaddedForward | NativePlan | None, *, view: bool) -> np.ndarray | None:
        """Write the inputs, run, keep idle rows, advance the lengths; the logits asked for
        (`view`: a one-row forward's last row may be a view of the binding's buffers)."""
        width = forward.width if plan is None else plan.width
        if isinstance(plan, NativePlan):
            write_native(binding, slot, forward, plan, self.ports, self.device)
        else:
            write_inputs(binding, slot, forward, plan, self.ports, self.device,
                         native=self.native, embedded=self._embedded)
        idle = [index for index, row in enumerate(forward.rows) if not row.steps]
        # Natively an idle row (query_seqlens 0) leaves its cache untouched: nothing to save.
        saved = [] if self.native else self._save_windows(slot, forward, idle)
        slot.buffers.bind_state(binding.io)

        def after(logits: DeviceBuffer) -> np.ndarray | None:
            if isinstance(plan, NativePlan):
                return self._native_result(binding, slot, forward, plan, logits, view)
            # cut_logits applies the shape rules (and the padding self-check) to a view that
            # holds the shape only: no logits are read here. A row-selecting session returned
            # the last real row alone.
            real_rows = forward.width
            returned = (1 if binding.output == LOGITS_OUTPUT and binding.row_index is not None
                        else logits.shape[1] if binding.logits_rows is not None
                        else real_rows if plan is None
                        else plan.cut_logits(shape_only(logits)).shape[1])
            if idle:
                slot.buffers.keep_state(idle)
            slot.buffers.swap_state()
            for buffer, index, array in saved:
                slot.buffers.write_row(buffer, index, array)
            for row in forward.rows:
                if row.steps:
                    row.length.advance(real_rows)
            return read_rows(logits, returned, real_rows, len(forward.rows), forward.logits,
                         binding.row, view)

        return self._run_bound(key, session, binding, slot, width, after)

    def _native_result(self, binding: Binding, slot: Slot, forward: Forward,
                       plan: NativePlan, logits: DeviceBuffer,
                       view: bool) -> np.ndarray | None:
        """After a native forward: keep idle rows' state, advance each stepping row by its
        real rows, read each row's logits at its last real row."""
        returned = logits.shape[1]
        selected = binding.output == LOGITS_OUTPUT and binding.row_index is not None
        # Rows fed to logits_rows: one per batch row (its last real row), or every real row.
        chosen = binding.logits_rows is not None
        if not selected and not chosen and returned != plan.width:
            if returned > plan.width or len(forward.rows) > 1:
                raise ModelStructureError(
                    f"a forward of {plan.width} query rows returned {returned} logits rows; "
                    "expected one row per query row")
            if plan.padded_rows:
                raise QueryAxisShrunk(returned, plan.width, plan.width - plan.padded_rows)
        idle = [index for index, row in enumerate(forward.rows) if not row.steps]
        if idle:
            slot.buffers.keep_state(idle)
        slot.buffers.swap_state()
        for row, count in zip(forward.rows, plan.query_lens.tolist()):
            if row.steps:
                row.length.advance(count)
        return read_native(logits, plan, len(forward.rows), forward.logits, selected=selected,
                           chosen=chosen, out=binding.row, view=view)

    def _save_windows(self, slot: Slot, forward: Forward,
                      idle: list[int]) -> list[tuple[DeviceBuffer, int, DeviceBuffer]]:
        """The window-cache rows of idle rows that this forward would evict (`idle_rows`),
        saved on the device (`BatchBuffers.save_row`: nothing crosses to the host)."""
        if not idle:
            return []
        buffers = slot.buffers
        lengths = [row.length.length for row in forward.rows]
        return [(buffer, index, buffers.save_row(buffer, index))
                for port, buffer in zip(self.ports.kv, buffers.kv)
                for index in evicting_rows(lengths, idle, port.shape[2], port.window)]

    def _gate(self, session: ort.InferenceSession, slot: Slot,
              width: int) -> contextlib.AbstractContextManager:
        """The capture gate as the next run of `slot` at `width` needs it.

        Alone for the run that captures a graph (CUDA's global capture mode fails on device
        work from any other thread); shared for every other forward of a runtime that may
        capture; not at all where nothing captures.
        """
        return self._gate_for(slot, self.variants.bindings(session, slot.number).get(width))

    def _gate_for(self, slot: Slot,
                  binding: Binding | None) -> contextlib.AbstractContextManager:
        """`_gate` for a binding already at hand (the decode loop's: no lookup per token)."""
        if binding is not None and binding.graphs is not None:
            if binding.graphs.captures_next(binding.logits is None, slot.buffers.parity):
                return CAPTURE_GATE.exclusive()
            return CAPTURE_GATE.shared()
        if self.device.cuda_graphs:
            return CAPTURE_GATE.shared()
        return contextlib.nullcontext()

    def _run_bound(self, key: VariantKey, session: ort.InferenceSession, binding: Binding,
                   slot: Slot, width: int, read: Callable[[DeviceBuffer], T]) -> T:
        """Run the bound forward and `read` its logits buffer, under the session's run lock.

        Logits ONNX Runtime allocated for this run (a binding's first run, a width that keeps
        no buffer of its own) sit in the session's arena, where a replay of another binding may
        write (`device.run_lock`): they are read, and let go, before the lock is released. A
        binding that keeps its own buffer takes one of the shape its first run returned (no
        copy: that run's rows are read from ONNX Runtime's output).
        """
        if binding.logits is not None:
            return self._run(session, binding, slot, width, False,
                             lambda: read(binding.logits))  # type: ignore[arg-type]
        then = functools.partial(self._read_produced, binding, slot, read)
        if self.device.host_visible:
            return self._run(session, binding, slot, width, True, then)
        # Off the host, a variant's arena and CUDA graph come with its first run: the cache
        # charges that growth to the variant (on CPU the resident set would also take in this
        # slot's KV pages, written for the first time here).
        return self.variants.cache.measure_growth(
            key, session, lambda: self._run(session, binding, slot, width, True, then))

    def _read_produced(self, binding: Binding, slot: Slot,
                       read: Callable[[DeviceBuffer], T]) -> T:
        """Under the run lock: read the logits ONNX Runtime allocated, then let them go (or,
        for a binding that keeps a buffer, bind one of that shape for good)."""
        produced = binding.io.get_outputs()[0]
        if binding.keeps_logits:
            own_logits(binding, tuple(produced.shape()), self.ports, self.device)
        try:
            return read(output_buffer(produced, self.ports.logits_dtype, self.device))
        finally:
            if binding.keeps_logits:
                binding.io.bind_ortvalue_output(LOGITS_OUTPUT, binding.logits.value)
            else:
                release_output(binding, slot, self.device)

    def _run(self, session: ort.InferenceSession, binding: Binding, slot: Slot,
             width: int, first_run: bool, then: Callable[[], T]) -> T:
        """Run `binding` once, under its graph id, and `then` under its run lock; a capture
        that fails runs without a graph.

        The one call of ONNX Runtime's run for a dynamic decoder (through `Device.run`).
        """
        device = self.device
        graphs = binding.graphs
        if graphs is None:
            return device.run(session, binding.io, None, then)  # type: ignore[return-value]
        parity = slot.buffers.parity
        if not graphs.captures_next(first_run, parity):
            if graphs.replays_next(first_run, parity):
                self.variants.graphs.replayed(graphs)

            def counted() -> T:  # the run happened: count it, whatever the read does
                graphs.ran(first_run, parity)
                return then()

            return device.run(session, binding.io, graphs.options(first_run, parity),
                              counted)  # type: ignore[return-value]
        try:
            self.variants.graphs.capture(
                session, graphs, parity, width,
                lambda options: device.run(session, binding.io, options))
        except Exception as error:  # ORT's own exception types
            self.variants.note_fallback(session, width, f"{type(error).__name__}: {error}")
            return device.run(session, binding.io, graphs.options(first_run, parity),
                              then)  # type: ignore[return-value]
        # The capture ran the forward (its replay); its logits are in the binding's own buffer.
        return then()

    def _binding(self, session: ort.InferenceSession, key: VariantKey, slot: Slot,
                 width: int, all_rows: bool = False) -> Binding:
        # The variant pool holds the bindings per live session and drops them when the cache
        # releases that session. A specialised session sees one width; the shape-generic one
        # keeps the last few widths it ran at. A row-selecting session (or a decoder with a
        # logits_rows input) asked for every row gets a binding of the full logits beside,
        # which never captures.
        selects = self.variants.selects_row(session)
        every_row = all_rows and (selects or self.ports.logits_rows is not None)
        name = (ALL_ROWS, width) if every_row else width
        bindings = self.variants.bindings(session, slot.number)
        binding = bindings.get(name)
        if binding is not None:
            bindings.move_to_end(name)
            return binding
        binding = new_binding(
            session, slot, width, self.ports, self.device, selects=selects, every_row=every_row,
            graphs=lambda: self.variants.graph_runs(
                session, width, stateful=bool(slot.buffers.state_ports),
                capture=not every_row and slot.captures and self._captures(key, width),
                batch=slot.mask.rows))
        bindings[name] = binding
        uncaptured = [held for held, kept in bindings.items()
                      if kept.graphs is None or not kept.graphs.ids]
        for held in uncaptured[:-BINDINGS_PER_SESSION]:
            del bindings[held]
        return binding

    def _captures(self, key: VariantKey, width: int) -> bool:
        """Whether a binding at `width` on the session of `key` captures a graph: where capture
        pays, at the widths that recur (decode at any batch, the ladder tiers) and on a session
        specialised for its width; other widths run uncaptured on the same session."""
        return key is not None or width == DECODE_WIDTH or width in self.tiers


if TYPE_CHECKING:  # mypy checks that the model runner is a forward runner on its slots
    _RUNS_FORWARDS: type[ForwardRunner[Slot]] = ModelRunner
