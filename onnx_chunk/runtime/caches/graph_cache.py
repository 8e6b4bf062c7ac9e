"""The captured CUDA graphs of a runtime: planned at load, held for the session's lifetime.

On CUDA the runtime holds one session per model (one copy of the weights); a CUDA graph is
captured per binding: one slot's buffers (its addresses) at one query width and batch (its
shape), under graph ids of its own (`cuda_graphs`). ONNX Runtime's CUDA provider frees captured
graphs only with their session (onnxruntime/core/providers/cuda/cuda_graph.cc: "Currently all
the captured graphs will be tied to the session's lifecycle"), so a graph once captured is held
until the session goes, and the bound holds by construction instead of by eviction:

1. The plan (`GraphPlan`, made at load from what the runtime will run): the batch engine's
   decode at its slot count, and a lone sequence's decode and ladder tiers, each once per state
   parity. `planned` is how many graphs that allows.
2. Each planned key (batch, width, parity) is captured by one binding, its holder, and never by
   another: a second binding at a held key, and any shape outside the plan, runs uncaptured
   (graph id -1; `outside_plan` counts such bindings). So `alive <= planned` at every moment.
3. Ids are handed out once (`new_runs`), counting up from FIRST_GRAPH_ID: two bindings never
   share an id, and an id is never given again.
4. A holder whose slot is freed (`release`) gives its keys back only where ONNX Runtime really
   frees its graphs (`cuda_graphs.releases_graphs`); elsewhere its graphs stay alive with the
   session and its keys stay taken (`stranded`), until `recreated` (a new session: the one way
   the CUDA provider frees graphs; `recreations` counts it).
5. Each graph is charged the device bytes its capture run added (`MemoryMeter` read before and
   after the first user run under its id, which is the capture; under the gate held alone).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import onnxruntime as ort

from onnx_chunk.runtime.caches.cuda_graphs import (
    FIRST_GRAPH_ID,
    GraphRuns,
    graph_runs,
    release_graphs,
    uncaptured,
)
from onnx_chunk.runtime.device.memory import MemoryMeter, measured

logger = logging.getLogger(__name__)

OUTSIDE_PLAN = "outside the graph plan"
KEY_HELD = "its planned graph is held by another binding"

PlanKey = tuple[int, int]  # (batch rows, query width)


@dataclass(frozen=True)
class GraphPlan:
    """The graph keys a runtime may capture: (batch rows, query width) shapes, each with how
    many bindings may capture it (the engine's decode at batch 1 and a lone sequence's decode
    are two), once per state parity (two for a model whose state buffers alternate)."""

    shapes: tuple[tuple[PlanKey, int], ...] = ()
    parities: int = 1

    @property
    def planned(self) -> int:
        """How many graphs the plan allows."""
        return sum(count for _, count in self.shapes) * self.parities

    def count(self, shape: PlanKey) -> int:
        """How many bindings may capture `shape`."""
        return dict(self.shapes).get(shape, 0)


def plan_graphs(tiers: Iterable[int], engine_slots: int, stateful: bool,
                decode_width: int = 1) -> GraphPlan:
    """The plan of a runtime: the engine's batched decode at `engine_slots` rows, and a lone
    sequence's decode and ladder tiers at one row."""
    counts: dict[PlanKey, int] = {}
    for shape in ((engine_slots, decode_width), (1, decode_width),
                  *((1, tier) for tier in tiers if tier != decode_width)):
        counts[shape] = counts.get(shape, 0) + 1
    return GraphPlan(tuple(sorted(counts.items())), 2 if stateful else 1)


@dataclass
class GraphStats:
    """Counters of the runtime's CUDA graphs; every one is bumped by the event it names.

    `planned`: graphs the plan allows; `alive`: graphs captured and still held by ONNX Runtime
    (never more than `planned`); `captures`, `replays`: runs that captured or replayed a graph;
    `recaptures`: runs of an id already captured, run as a capture in another thread (the CUDA
    provider keeps graphs per thread context; whether it captured again is the probe's row);
    `released`: graphs ONNX Runtime freed with their slot (only where its provider frees them);
    `stranded`: graphs of freed slots that ONNX Runtime keeps until the session goes;
    `outside_plan`: bindings that ran uncaptured because their shape is outside the plan or
    its key is held; `recreations`: sessions recreated to change the plan; `bytes`: the device
    bytes of the alive graphs as measured at their capture (`peak_bytes`, `peak_alive`: the
    most at once); `by_width`: captures per query width; `fallbacks`: widths whose capture
    failed, and why. `evictions` stays 0 (graphs are never evicted; kept for readers of the
    older counters).
    """

    planned: int = 0
    alive: int = 0
    peak_alive: int = 0
    captures: int = 0
    replays: int = 0
    recaptures: int = 0
    released: int = 0
    stranded: int = 0
    outside_plan: int = 0
    recreations: int = 0
    evictions: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    by_width: dict[int, int] = field(default_factory=dict)
    fallbacks: dict[int | str, str] = field(default_factory=dict)


@dataclass
class _Entry:
    """The planned keys one binding holds, and the graphs it captured under them."""

    session: ort.InferenceSession
    runs: GraphRuns
    keys: tuple[tuple[int, int, int, int], ...]
    sizes: dict[int, int] = field(default_factory=dict)


class GraphCache:
    """The runtime's CUDA graphs under its plan; see the module docstring."""

    def __init__(self, plan: GraphPlan | None = None, meter: MemoryMeter | None = None) -> None:
        self._meter = meter
        self._lock = threading.Lock()
        self._ids = itertools.count(FIRST_GRAPH_ID)
        self._plan = plan if plan is not None else GraphPlan()
        # Planned keys (batch, width, holder index, parity) taken, by the binding (GraphRuns
        # id) holding them.
        self._held: dict[tuple[int, int, int, int], int] = {}
        self._entries: dict[int, _Entry] = {}
        self.stats = GraphStats(planned=self._plan.planned)

    @property
    def plan(self) -> GraphPlan:
        return self._plan

    def new_runs(self, session: ort.InferenceSession, batch: int, width: int,
                 stateful: bool) -> GraphRuns:
        """The graph runs of a new binding at (`batch`, `width`) on `session`: fresh ids under
        the plan's keys when they are free, else a binding that never captures (rule 2)."""
        parities = 2 if stateful else 1
        with self._lock:
            count = self._plan.count((batch, width)) if parities == self._plan.parities else 0
            free = [tuple((batch, width, holder, parity) for parity in range(parities))
                    for holder in range(count)]
            free = [keys for keys in free if not any(key in self._held for key in keys)]
            if not free:
                self.stats.outside_plan += 1
                reason = OUTSIDE_PLAN if count == 0 else KEY_HELD
                logger.debug("binding at batch %d, width %d runs uncaptured: %s", batch, width,
                             reason)
                return uncaptured(reason)
            keys = free[0]
            ids = tuple(next(self._ids) for _ in range(parities))
            runs = graph_runs(ids)
            for key in keys:
                self._held[key] = id(runs)
            self._entries[id(runs)] = _Entry(session, runs, keys)
        return runs

    def capture(self, session: ort.InferenceSession, runs: GraphRuns, parity: int, width: int,
                run: Callable[[ort.RunOptions], None]) -> bool:
        """The capture run of `runs` at `parity` (the caller holds the capture gate alone): the
        first user run under its id, measured; whether a graph was captured. An exception of
        the run reaches the caller (which falls back)."""
        options = runs.options(False, parity)
        if self._meter is None:
            run(options)
            size = None
        else:
            size = measured(self._meter, lambda: run(options))[1]
        if not runs.ran(False, parity):
            # An id captured before, run again as a capture in another thread (or after a
            # claim): the CUDA provider may have captured it anew in that thread's context.
            with self._lock:
                self.stats.recaptures += 1
            return False
        graph = runs.graph(parity)
        with self._lock:
            entry = self._entries.get(id(runs))
            if entry is None:  # the plan was recreated meanwhile: not this session's any more
                return False
            entry.sizes[graph] = size or 0
            stats = self.stats
            stats.captures += 1
            stats.alive += 1
            stats.peak_alive = max(stats.peak_alive, stats.alive)
            stats.bytes += size or 0
            stats.peak_bytes = max(stats.peak_bytes, stats.bytes)
            stats.by_width[width] = stats.by_width.get(width, 0) + 1
        logger.debug("captured CUDA graph %d (width %d, %s bytes)", graph, width,
                     "unmeasured" if size is None else size)
        return True

    def replayed(self, runs: GraphRuns) -> None:
        """A run replayed a graph of `runs`."""
        with self._lock:
            self.stats.replays += 1

    def release(self, session: ort.InferenceSession, runs: GraphRuns) -> int:
        """The binding of `runs` is dropped (its slot is freed): free its graphs where ONNX
        Runtime can and give its keys back; else its graphs stay with the session (rule 4)."""
        with self._lock:
            entry = self._entries.get(id(runs))
            if entry is None or entry.session is not session:
                return 0
        released = release_graphs(session, tuple(entry.sizes))
        with self._lock:
            if self._entries.get(id(runs)) is not entry:
                return 0
            if released == len(entry.sizes):
                del self._entries[id(runs)]
                for key in entry.keys:
                    self._held.pop(key, None)
                self._forgotten(entry)
                self.stats.released += released
            else:
                self.stats.stranded += len(entry.sizes)
                runs.fall_back("its slot was freed")
        return released

    def forget_session(self, session: ort.InferenceSession) -> None:
        """`session` is released: its graphs go with it, and their keys are free again."""
        with self._lock:
            gone = [key for key, entry in self._entries.items() if entry.session is session]
            for key in gone:
                entry = self._entries.pop(key)
                for held in entry.keys:
                    self._held.pop(held, None)
                entry.runs.fall_back("its session was released")
                self._forgotten(entry)
            self.stats.stranded = sum(len(entry.sizes) for entry in self._entries.values()
                                      if entry.runs.failure is not None)

    def recreated(self, plan: GraphPlan) -> None:
        """A new session replaces the capturing one under `plan` (the caller released the old
        one, and with it its graphs: `forget_session`)."""
        with self._lock:
            self._plan = plan
            self.stats.planned = plan.planned
            self.stats.recreations += 1

    def note_fallback(self, width: int, reason: str) -> None:
        with self._lock:
            self.stats.fallbacks[width] = reason

    def snapshot(self) -> GraphStats:
        """A copy of the counters, consistent at one instant."""
        with self._lock:
            stats = self.stats
            return GraphStats(**{**stats.__dict__, "by_width": dict(stats.by_width),
                                 "fallbacks": dict(stats.fallbacks)})

    def _forgotten(self, entry: _Entry) -> None:
        self.stats.alive -= len(entry.sizes)
        self.stats.bytes -= sum(entry.sizes.values())
