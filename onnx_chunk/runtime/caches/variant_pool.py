"""The variant pool: the runtime's sessions and everything that hangs off them.

One object, built once by the runtime and handed to whoever runs forwards (`forward`, the
batch engine): the bounded variant cache (`variant_cache`), which decides when a session is
built and released; the building (through the session factory) and the releasing; the
IOBindings every sequence slot (`sequence_pool`) keeps on a live session, by width; the CUDA
graphs those bindings captured and their counters; and the padding switch, which the padding
self-check turns off for good. It holds no reference to the runtime, so a runtime is freed as
soon as its last reference goes (no reference cycle waits for the garbage collector with the
device memory held).

Graph lifetime: a captured graph belongs to (session, graph id), and a slot's graph ids are the
same on every session (`cuda_graphs.graph_id`). It is freed when its session is released
(eviction, close) or when its slot is freed (`release_slot`: the sequence pool drops a slot),
through `InferenceSession.release_captured_graph`. A slot that goes back to the pool keeps its
bindings and graphs: the next sequence that takes it replays them without capturing again.
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
    graph_runs,
    release_graphs,
    session_captures,
    uncaptured,
)
from onnx_chunk.runtime.caches.variant_cache import VariantCache, VariantKey, key_label
from onnx_chunk.runtime.device.memory import MemoryMeter
from onnx_chunk.runtime.device.session_factory import SessionFactory

logger = logging.getLogger(__name__)


@dataclass
class GraphCounters:
    """What happened to CUDA graphs: captures, releases and the widths that fell back.

    `by_width` counts the captures per width; `fallbacks` maps a width to why its capture
    failed (it runs without a graph since).
    """

    captured: int = 0
    released: int = 0
    by_width: dict[int, int] = field(default_factory=dict)
    fallbacks: dict[int | str, str] = field(default_factory=dict)


@dataclass
class _Kept:
    """What hangs off the live sessions. The pool and its cache's build and release share it,
    so the cache never refers back to the pool (no reference cycle)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # Sessions whose logits are the one row their `logits_row` input picks.
    row_sessions: set[ort.InferenceSession] = field(default_factory=set)
    # Per session, per slot number: that slot's bindings, by width.
    bindings: dict[ort.InferenceSession, dict[int, OrderedDict]] = field(default_factory=dict)
    capturing: dict[ort.InferenceSession, VariantKey] = field(default_factory=dict)
    graph_widths: set[int] = field(default_factory=set)

    def release(self, session: ort.InferenceSession) -> None:
        """Drop everything kept on `session` (the cache's release); its graphs go with it."""
        with self.lock:
            self.bindings.pop(session, None)
            self.capturing.pop(session, None)
            self.row_sessions.discard(session)


def _build(factory: SessionFactory, kept: _Kept, specialize: bool | str, quantized: bool,
           select_rows: bool, key: VariantKey) -> ort.InferenceSession:
    """A session for `key` (the cache's build)."""
    # Pre-pack where it pays (see session_factory): the decode shape, a lone session that
    # also decodes, and every session of a model with quantized MatMulNBits weights.
    prepack = key == DECODE_WIDTH or not specialize or quantized
    last_row = select_rows and key not in (None, DECODE_WIDTH)
    with CAPTURE_GATE.shared():
        session = factory.create(key, prepack=prepack, capture=capturable(factory.device, key),
                                 last_row=last_row)
    with kept.lock:
        if last_row:
            kept.row_sessions.add(session)
        if key is not None and session_captures(session):
            kept.capturing[session] = key
            kept.graph_widths.add(key)
    return session


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
        self._kept = _Kept()
        self.graphs = GraphCounters()
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

    @property
    def graph_widths(self) -> set[int]:
        """The widths whose sessions capture CUDA graphs."""
        with self._kept.lock:
            return set(self._kept.graph_widths)

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

    def graph_runs(self, session: ort.InferenceSession, slot: int, stateful: bool, *,
                   capture: bool = True) -> GraphRuns | None:
        """The graph run options of a new binding of `slot` on `session` (None: the session
        captures nothing); `capture=False`: a binding that must not capture on it."""
        with self._kept.lock:
            captures = session in self._kept.capturing
        if not captures:
            return None
        return graph_runs(slot, stateful) if capture else uncaptured()

    def note_capture(self, width: int) -> None:
        with self._kept.lock:
            self.graphs.captured += 1
            self.graphs.by_width[width] = self.graphs.by_width.get(width, 0) + 1

    def note_fallback(self, session: ort.InferenceSession, width: int, reason: str) -> None:
        """A capture on `session` failed: its width runs without a graph, for every slot."""
        logger.warning("capturing a CUDA graph for width %d failed, running it without: %s",
                       width, reason)
        kept = self._kept
        with kept.lock:
            kept.capturing.pop(session, None)
            self.graphs.fallbacks[key_label(width)] = reason
            for bindings in kept.bindings.get(session, {}).values():
                for binding in bindings.values():
                    if binding.graphs is not None:
                        binding.graphs.fall_back(reason)

    def release_slot(self, slot: int) -> None:
        """Drop slot `slot`'s bindings on every live session and free the graphs they captured."""
        kept = self._kept
        with kept.lock:
            held = [(session, per_slot.pop(slot)) for session, per_slot in kept.bindings.items()
                    if slot in per_slot]
        released = 0
        with CAPTURE_GATE.shared():
            for session, bindings in held:
                for binding in bindings.values():
                    if binding.graphs is not None and binding.graphs.captured:
                        released += release_graphs(session, binding.graphs.captured)
        with kept.lock:
            self.graphs.released += released
