"""The variant pool: the runtime's sessions and everything that hangs off them.

One object, built once by the runtime and handed to whoever runs forwards (`forward`, the
batch engine): the bounded variant cache (`variant_cache`), which decides when a session is
built and released; the building (through the session factory) and the releasing; the
IOBindings every sequence slot (`sequence_pool`) keeps on a live session, by width; the bounded
cache of the CUDA graphs those bindings captured (`graph_cache`); and the padding switch, which
the padding self-check turns off for good. It holds no reference to the runtime, so a runtime
is freed as soon as its last reference goes (no reference cycle waits for the garbage collector
with the device memory held).

Graph lifetime: a captured graph belongs to (session, graph id), and graph ids are the
binding's own (one slot at one width). It is freed when the graph cache evicts it (its binding
is dropped with it), when its slot is freed (`release_slot`: the sequence pool drops a slot),
through `InferenceSession.release_captured_graph`, or with its session. A slot that goes back
to the pool keeps its bindings and graphs: the next sequence that takes it replays them without
capturing again.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
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
from onnx_chunk.runtime.caches.graph_cache import GraphCache
from onnx_chunk.runtime.caches.variant_cache import VariantCache, VariantKey
from onnx_chunk.runtime.device.memory import MemoryMeter
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
    return session


def _drop_binding(kept_ref: weakref.ref, session: ort.InferenceSession, slot: int, name: object,
                  runs: GraphRuns) -> None:
    kept = kept_ref()
    if kept is None:
        return
    with kept.lock:
        held = kept.bindings.get(session, {}).get(slot)
        if held is not None and name in held and held[name].graphs is runs:
            del held[name]


class VariantPool:
    """The variant cache, its sessions' building, bindings and graphs, and the padding switch."""

    def __init__(self, factory: SessionFactory, *, specialize: bool | str, quantized: bool,
                 cap: int, meter: MemoryMeter | None = None, select_rows: bool = False,
                 padding: bool = False, padding_refused: str | None = None) -> None:
        """`select_rows`: specialised prefill widths return the one logits row asked for
        (logits_row); `padding`: whether prefill chunks are padded up the ladder
        (`padding_refused`: why not, when not)."""
        self.factory = factory
        self.select_rows = select_rows
        # One cap bounds both: the sessions (one on CUDA, per width where asked for) and the
        # CUDA graphs captured on them.
        self.graphs = GraphCache(cap, meter)
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

    def graph_runs(self, session: ort.InferenceSession, width: int, stateful: bool, *,
                   capture: bool = True) -> GraphRuns | None:
        """The graph run options of a new binding at `width` on `session` (None: the session
        captures nothing); `capture=False`, or a width whose capture failed on it: a binding
        that runs uncaptured (graph id -1) on the capturing session."""
        with self._kept.lock:
            captures = session in self._kept.capturing
            fallen = width in self._kept.fallen.get(session, ())
        if not captures:
            return None
        if not capture or fallen:
            return uncaptured()
        return self.graphs.new_runs(stateful)

    def dropper(self, session: ort.InferenceSession, slot: int, name: object,
                runs: GraphRuns) -> Callable[[], None]:
        """What forgets the binding `name` of `slot` on `session` whose graphs are `runs`, when
        the graph cache evicts them: the next forward there binds fresh buffers. It refers to
        what the pool keeps weakly (the graph cache holds it: no reference cycle)."""
        return functools.partial(_drop_binding, weakref.ref(self._kept), session, slot, name,
                                 runs)

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

    def release_slot(self, slot: int) -> None:
        """Drop slot `slot`'s bindings on every live session and free the graphs they captured."""
        kept = self._kept
        with kept.lock:
            held = [(session, per_slot.pop(slot)) for session, per_slot in kept.bindings.items()
                    if slot in per_slot]
        with CAPTURE_GATE.shared():
            for session, bindings in held:
                for binding in bindings.values():
                    if binding.graphs is not None:
                        self.graphs.release(session, binding.graphs)
