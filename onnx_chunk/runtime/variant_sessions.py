"""The sessions behind the variant cache, and the IOBindings each sequence slot keeps on them.

The variant cache decides when a session is built and released; this object does the building
and the releasing, and owns what hangs off a live session: the IOBindings of every sequence
slot (`sequence_pool`) that ran on it, by width, and the CUDA graphs those bindings captured.
It holds no reference to the runtime, so a runtime is freed as soon as its last reference
goes (no reference cycle waits for the garbage collector with the device memory held).

Graph lifetime: a captured graph belongs to (session, graph id), and a slot's graph ids are the
same on every session (`cuda_graphs.graph_id`). It is freed when its session is released
(eviction, close) or when its slot is freed (`release_slot`: the sequence pool drops a slot),
through `InferenceSession.release_captured_graph`. A slot that goes back to the pool keeps its
bindings and graphs: the next sequence that takes it replays them without capturing again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import onnxruntime as ort

from onnx_chunk.runtime.cuda_graphs import (CAPTURE_GATE, GraphRuns, capturable, graph_runs,
                                            release_graphs, session_captures, uncaptured)
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.session_factory import SessionFactory
from onnx_chunk.runtime.variant_cache import VariantKey, key_label

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


class VariantSessions:
    """Builds the cache's sessions and keeps each slot's bindings and graphs on them."""

    def __init__(self, factory: SessionFactory, *, specialize: bool | str,
                 quantized: bool, select_rows: bool = False) -> None:
        self.factory = factory
        self.device = factory.device
        self._specialize = specialize
        self._quantized = quantized
        # Specialised prefill widths return the one logits row asked for (logits_row).
        self.select_rows = select_rows
        self._lock = threading.Lock()
        self._row_sessions: set[ort.InferenceSession] = set()
        self._bindings: dict[ort.InferenceSession, dict[int, OrderedDict]] = {}
        self._capturing: dict[ort.InferenceSession, VariantKey] = {}
        self.graph_widths: set[int] = set()
        self.graphs = GraphCounters()

    def build(self, key: VariantKey) -> ort.InferenceSession:
        """A session for `key` (the cache's build)."""
        # Pre-pack where it pays (see session_factory): the decode shape, a lone session that
        # also decodes, and every session of a model with quantized MatMulNBits weights.
        prepack = key == DECODE_WIDTH or not self._specialize or self._quantized
        last_row = self.select_rows and key not in (None, DECODE_WIDTH)
        with CAPTURE_GATE.shared():
            session = self.factory.create(key, prepack=prepack,
                                          capture=capturable(self.device, key),
                                          last_row=last_row)
        with self._lock:
            if last_row:
                self._row_sessions.add(session)
            if key is not None and session_captures(session):
                self._capturing[session] = key
                self.graph_widths.add(key)
        return session

    def selects_row(self, session: ort.InferenceSession) -> bool:
        """Whether `session`'s logits are the one row its `logits_row` input picks."""
        with self._lock:
            return session in self._row_sessions

    def release(self, session: ort.InferenceSession) -> None:
        """Drop everything kept on `session` (the cache's release); its graphs go with it."""
        with self._lock:
            self._bindings.pop(session, None)
            self._capturing.pop(session, None)
            self._row_sessions.discard(session)

    def bindings(self, session: ort.InferenceSession, slot: int) -> OrderedDict:
        """The IOBindings slot `slot` keeps on a live `session`, by width (the caller fills it)."""
        with self._lock:
            per_slot = self._bindings.get(session)
            if per_slot is None:
                per_slot = self._bindings[session] = {}
            kept = per_slot.get(slot)
            if kept is None:
                kept = per_slot[slot] = OrderedDict()
            return kept

    def graph_runs(self, session: ort.InferenceSession, slot: int, stateful: bool, *,
                   capture: bool = True) -> GraphRuns | None:
        """The graph run options of a new binding of `slot` on `session` (None: the session
        captures nothing); `capture=False`: a binding that must not capture on it."""
        with self._lock:
            captures = session in self._capturing
        if not captures:
            return None
        return graph_runs(slot, stateful) if capture else uncaptured()

    def note_capture(self, width: int) -> None:
        with self._lock:
            self.graphs.captured += 1
            self.graphs.by_width[width] = self.graphs.by_width.get(width, 0) + 1

    def note_fallback(self, session: ort.InferenceSession, width: int, reason: str) -> None:
        """A capture on `session` failed: its width runs without a graph, for every slot."""
        logger.warning("capturing a CUDA graph for width %d failed, running it without: %s",
                       width, reason)
        with self._lock:
            self._capturing.pop(session, None)
            self.graphs.fallbacks[key_label(width)] = reason
            for bindings in self._bindings.get(session, {}).values():
                for binding in bindings.values():
                    if binding.graphs is not None:
                        binding.graphs.fall_back(reason)

    def release_slot(self, slot: int) -> None:
        """Drop slot `slot`'s bindings on every live session and free the graphs they captured."""
        with self._lock:
            held = [(session, per_slot.pop(slot)) for session, per_slot in self._bindings.items()
                    if slot in per_slot]
        released = 0
        with CAPTURE_GATE.shared():
            for session, bindings in held:
                for binding in bindings.values():
                    if binding.graphs is not None and binding.graphs.captured:
                        released += release_graphs(session, binding.graphs.captured)
        with self._lock:
            self.graphs.released += released
