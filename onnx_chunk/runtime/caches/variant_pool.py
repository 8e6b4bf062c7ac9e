"""The variant pool: the runtime's sessions and everything that hangs off them.

One object, built once by the runtime and handed to whoever runs forwards (`forward`, the
batch engine): the bounded variant cache (`variant_cache`), which decides when a session is
built and released; the building (through the session factory) and the releasing; the
IOBindings every sequence slot (`sequence_pool`) keeps on a live session, by width; the bounded
cache of the CUDA graphs those bindings captured (`graph_cache`); and the padding switch, which
the padding self-check turns off for good. It holds no reference to the runtime, so a runtime
is freed as soon as its last reference goes (no reference cycle waits for the garbage collector
with the device memory held).

Graph lifetime = session lifetime (ONNX Runtime's CUDA provider frees graphs only with their
session: onnxruntime/core/providers/cuda/cuda_graph.cc). A captured graph belongs to (session,
graph id), and graph ids are the binding's own (one slot at one width and batch), handed out
under the plan made at load (`graph_cache`): at most `planned` graphs are ever alive, and a
shape outside the plan runs uncaptured. A slot that goes back to the pool keeps its bindings
and graphs: the next sequence that takes it replays them without capturing again. A slot that
is freed (`release_slot`) drops its bindings; its graphs are released only where ONNX Runtime
frees them, else they stay with the session and their keys stay taken. A slot whose bindings
move to another thread (`claim`: the batch engine's new thread) keeps them and their ids; each
id's next run there runs as a capture (the CUDA provider keeps graphs per thread). Changing the
plan (`replan`) recreates the session, the one way to free graphs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import onnxruntime as ort

from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.caches.cuda_graphs import (
    CAPTURE_GATE,
    GraphRuns,
    capturable,
    session_captures,
    uncaptured,
)
from onnx_chunk.runtime.caches.graph_cache import GraphCache, GraphPlan
from onnx_chunk.runtime.caches.variant_cache import VariantCache, VariantKey
from onnx_chunk.runtime.device.memory import MemoryMeter
from onnx_chunk.runtime.device.run_lock import serialise_runs
from onnx_chunk.runtime.device.session_factory import SessionFactory

logger = logging.getLogger(__name__)


@dataclass
class _Kept:
    """What hangs off the live sessions. The pool and its cache's build and release share it,
    so the cache never refers back to the pool (no reference cycle)."""

    graphs: GraphCache
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Sessions whose logits are the one row their `logits_row` input picks.
    row_sessions: set[ort.InferenceSession] = field(default_factory=set)
    # Per session, per slot number: that slot's bindings, by width.
    bindings: dict[ort.InferenceSession, dict[int, OrderedDict]] = field(default_factory=dict)
    capturing: set[ort.InferenceSession] = field(default_factory=set)
    # Per capturing session, the widths whose capture failed (they run without a graph).
    fallen: dict[ort.InferenceSession, set[int]] = field(default_factory=dict)

    def release(self, session: ort.InferenceSession) -> None:
        """Drop everything kept on `session` (the cache's release); its graphs go with it."""
        with self.lock:
            self.bindings.pop(session, None)
            self.capturing.discard(session)
            self.fallen.pop(session, None)
            self.row_sessions.discard(session)
        self.graphs.forget_session(session)


def _build(factory: SessionFactory, kept: _Kept, specialize: bool | str, quantized: bool,
           select_rows: bool, key: VariantKey) -> ort.InferenceSession:
    """A session for `key` (the cache's build)."""
    # Pre-pack where it pays (see session_factory): the decode shape, a lone session that
    # also decodes, and every session of a model with quantized MatMulNBits weights.
    prepack = key == DECODE_WIDTH or not specialize or quantized
    # The decode session returns one row already; the shape-generic session (on CUDA the one
    # session of the model) serves prefill widths too, so it selects its row.
    last_row = select_rows and key != DECODE_WIDTH
    capture = capturable(factory.device)
    with CAPTURE_GATE.shared():
        session = factory.create(key, prepack=prepack, capture=capture, last_row=last_row)
    with kept.lock:
        if last_row:
            kept.row_sessions.add(session)
        if capture and session_captures(session):
            kept.capturing.add(session)
            serialise_runs(session)
    return session


class VariantPool:
    """The variant cache, its sessions' building, bindings and graphs, and the padding switch."""

    def __init__(self, factory: SessionFactory, *, specialize: bool | str, quantized: bool,
                 cap: int, meter: MemoryMeter | None = None, select_rows: bool = False,
                 padding: bool = False, padding_refused: str | None = None,
                 graph_plan: GraphPlan | None = None) -> None:
        """`select_rows`: specialised prefill widths return the one logits row asked for
        (logits_row); `padding`: whether prefill chunks are padded up the ladder
        (`padding_refused`: why not, when not); `graph_plan`: the CUDA graphs the runtime may
        capture (`graph_cache.plan_graphs`; none without one)."""
        self.factory = factory
        self.select_rows = select_rows
        # The cap bounds the sessions (one on CUDA, per width where asked for); the plan bounds
        # the CUDA graphs captured on them.
        self.graphs = GraphCache(graph_plan, meter)
        self._kept = _Kept(self.graphs)
        self.cache: VariantCache[ort.InferenceSession] = VariantCache(
            functools.partial(_build, factory, self._kept, specialize, quantized, select_rows),
            self._kept.release, cap=cap, meter=meter)
        self.cache.note_padding_refused(padding_refused)
        self._padding = padding
        self._padding_lock = threading.Lock()
        self._closed = False

    @property
    def padding(self) -> bool:
        """Whether prefill chunks are padded up the ladder."""
        return self._padding

    def disable_padding(self, reason: str) -> None:
        """Switch padding off for good (the run-time self-check found it unsafe)."""
        with self._padding_lock:
            if self._padding:
                logger.warning("padding switched off: %s", reason)
                self._padding = False
                self.cache.note_padding_refused(reason)

    def close(self) -> None:
        """Release every session (a pinned one when its forward ends); no forward after."""
        self._closed = True
        self.cache.close()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def selects_row(self, session: ort.InferenceSession) -> bool:
        """Whether `session`'s logits are the one row its `logits_row` input picks."""
        with self._kept.lock:
            return session in self._kept.row_sessions

    def bindings(self, session: ort.InferenceSession, slot: int) -> OrderedDict:
        """The IOBindings slot `slot` keeps on a live `session`, by width (the caller fills it)."""
        kept = self._kept
        with kept.lock:
            per_slot = kept.bindings.get(session)
            if per_slot is None:
                per_slot = kept.bindings[session] = {}
            held = per_slot.get(slot)
            if held is None:
                held = per_slot[slot] = OrderedDict()
            return held

    def live_bindings(self) -> list[dict[int, dict]]:
        """Per live session, every slot's bindings by width: a copy, for diagnosis."""
        with self._kept.lock:
            return [{slot: dict(held) for slot, held in per_slot.items()}
                    for per_slot in self._kept.bindings.values()]

    def graph_runs(self, session: ort.InferenceSession, width: int, stateful: bool, *,
                   capture: bool = True, batch: int = 1) -> GraphRuns | None:
        """The graph run options of a new binding at `width` and `batch` rows on `session`
        (None: the session captures nothing); `capture=False`, a width whose capture failed
        on it, or a shape outside the plan (or whose planned key another binding holds): a
        binding that runs uncaptured (graph id -1) on the capturing session."""
        with self._kept.lock:
            captures = session in self._kept.capturing
            fallen = width in self._kept.fallen.get(session, ())
        if not captures:
            return None
        if not capture or fallen:
            return uncaptured()
        return self.graphs.new_runs(session, batch, width, stateful)

    def note_fallback(self, session: ort.InferenceSession, width: int, reason: str) -> None:
        """A capture at `width` on `session` failed: that width runs without a graph there,
        for every slot."""
        logger.warning("capturing a CUDA graph for width %d failed, running it without: %s",
                       width, reason)
        kept = self._kept
        with kept.lock:
            kept.fallen.setdefault(session, set()).add(width)
            for bindings in kept.bindings.get(session, {}).values():
                for name, binding in bindings.items():
                    if binding.graphs is not None and name == width:
                        binding.graphs.fall_back(reason)
        self.graphs.note_fallback(width, reason)

    def claim(self, slot: int) -> None:
        """Slot `slot`'s bindings run in the calling thread from now on (the batch engine's new
        thread): they keep their buffers and graph ids, and each id's next run there runs as a
        capture (the CUDA provider keeps graphs per thread: cuda_execution_provider.cc)."""
        with self._kept.lock:
            held = [binding for per_slot in self._kept.bindings.values()
                    for binding in per_slot.get(slot, {}).values()]
        for binding in held:
            if binding.graphs is not None:
                binding.graphs.claim()

    def replan(self, plan: GraphPlan) -> bool:
        """Capture under `plan` from now on; where it differs from the plan in force, every
        idle session is released (with its graphs: the one way the CUDA provider frees them)
        and the next forward builds a new one, counted in `graphs.recreations`. Whether the
        plan changed."""
        if plan == self.graphs.plan:
            return False
        self.cache.clear()
        self.graphs.recreated(plan)
        logger.info("CUDA graph plan changed to %d graphs: session recreated", plan.planned)
        return True

    def release_slot(self, slot: int) -> None:
        """Drop slot `slot`'s bindings on every live session; their graphs are freed where ONNX
        Runtime frees them (else they stay with the session, their keys taken)."""
        kept = self._kept
        with kept.lock:
            held = [(session, per_slot.pop(slot)) for session, per_slot in kept.bindings.items()
                    if slot in per_slot]
        with CAPTURE_GATE.shared():
            for session, bindings in held:
                for binding in bindings.values():
                    if binding.graphs is not None:
                        self.graphs.release(session, binding.graphs)
