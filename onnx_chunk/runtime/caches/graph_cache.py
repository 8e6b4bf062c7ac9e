"""The bounded cache of captured CUDA graphs, keyed by shape and addresses.

On CUDA the runtime holds one session per model (one copy of the weights); what a per-shape
cache used to hold as a session per width is now a CUDA graph per binding: one slot's buffers
(its addresses) at one query width and batch (its shape), captured on that session under graph
ids of its own (`cuda_graphs`). Rules:

1. Ids are handed out once (`new_runs`), counting up from FIRST_GRAPH_ID: two bindings never
   share an id, and an id is never given again, so a released id cannot be replayed by mistake.
2. At most `cap` graphs are alive (captured, not yet released). A capture that would pass the
   cap first evicts the least recently used binding's graphs (captured or replayed longest
   ago): `InferenceSession.release_captured_graph` for each, its bindings dropped through the
   entry's `drop` (so no sequence replays freed addresses), its GraphRuns marked evicted (a
   loop still holding that binding runs it uncaptured). Eviction runs under the capture gate
   held alone, so no forward of another thread runs meanwhile.
3. When the cap is held by the capturing binding's own graphs alone (cap 1, a stateful model's
   second parity), the run goes uncaptured instead (`skipped`).
4. Each graph is charged the device bytes its capture run added (`MemoryMeter` read before and
   after, under the gate held alone, so no other work is inside the reading).
5. A graph freed with its slot (`release`) counts as released; one freed with its session
   (`forget_session`: eviction of a per-width session, close) as neither.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import onnxruntime as ort

from onnx_chunk.runtime.caches.cuda_graphs import (
    FIRST_GRAPH_ID,
    GraphRuns,
    graph_runs,
    release_graphs,
)
from onnx_chunk.runtime.device.memory import MemoryMeter, measured

logger = logging.getLogger(__name__)

EVICTED = "evicted from the graph cache"


@dataclass
class GraphStats:
    """Counters of the graph cache; every one is bumped by the event it names.

    `alive`: graphs captured and not released; `captures`, `replays`: runs that captured or
    replayed a graph; `evictions`: graphs released to make room under `cap`; `released`:
    graphs released with their sequence slot; `skipped`: captures not made because the cap
    held only the capturing binding's own graphs; `bytes`: the device bytes of the alive
    graphs as measured at their capture (`peak_bytes`, `peak_alive`: the most at once);
    `by_width`: captures per query width; `fallbacks`: widths whose capture failed, and why.
    """

    cap: int
    alive: int = 0
    peak_alive: int = 0
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    released: int = 0
    skipped: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    by_width: dict[int, int] = field(default_factory=dict)
    fallbacks: dict[int | str, str] = field(default_factory=dict)


@dataclass
class _Entry:
    """The captured graphs of one binding, and how to drop that binding."""

    session: ort.InferenceSession
    runs: GraphRuns
    drop: Callable[[], None]
    sizes: dict[int, int] = field(default_factory=dict)


class GraphCache:
    """Captured CUDA graphs, bounded and evicted least-recently-used; see the module docstring."""

    def __init__(self, cap: int, meter: MemoryMeter | None = None) -> None:
        self._meter = meter
        self._lock = threading.Lock()
        self._ids = itertools.count(FIRST_GRAPH_ID)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.stats = GraphStats(cap=cap)

    def new_runs(self, stateful: bool) -> GraphRuns:
        """Fresh graph ids for a new binding (two when its state buffers alternate)."""
        with self._lock:
            ids = tuple(next(self._ids) for _ in range(2 if stateful else 1))
        return graph_runs(ids)

    def capture(self, session: ort.InferenceSession, runs: GraphRuns, parity: int, width: int,
                run: Callable[[ort.RunOptions], None], drop: Callable[[], None]) -> bool:
        """The capture run of `runs` at `parity` (the caller holds the capture gate alone):
        room made under the cap, the run measured; whether a graph was captured."""
        if not self._make_room(runs):
            run(runs.first)
            with self._lock:
                self.stats.skipped += 1
            return False
        options = runs.options(False, parity)
        if self._meter is None:
            run(options)
            size = None
        else:
            size = measured(self._meter, lambda: run(options))[1]
        if not runs.ran(False, parity):
            return False
        graph = runs.graph(parity)
        with self._lock:
            entry = self._entries.get(id(runs))
            if entry is None:
                entry = self._entries[id(runs)] = _Entry(session, runs, drop)
            self._entries.move_to_end(id(runs))
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
        """A run replayed a graph of `runs`: count it, and make it the most recently used."""
        with self._lock:
            self.stats.replays += 1
            if id(runs) in self._entries:
                self._entries.move_to_end(id(runs))

    def release(self, session: ort.InferenceSession, runs: GraphRuns) -> int:
        """Free the graphs `runs` captured on `session` (its slot is freed); how many."""
        with self._lock:
            entry = self._entries.pop(id(runs), None)
        if entry is None:
            return 0
        released = release_graphs(session, tuple(entry.sizes))
        with self._lock:
            self._forgotten(entry)
            self.stats.released += released
        return released

    def forget_session(self, session: ort.InferenceSession) -> None:
        """`session` is released: its graphs go with it (no release calls)."""
        with self._lock:
            gone = [key for key, entry in self._entries.items() if entry.session is session]
            for key in gone:
                self._forgotten(self._entries.pop(key))

    def note_fallback(self, width: int, reason: str) -> None:
        with self._lock:
            self.stats.fallbacks[width] = reason

    def snapshot(self) -> GraphStats:
        """A copy of the counters, consistent at one instant."""
        with self._lock:
            stats = self.stats
            return GraphStats(**{**stats.__dict__, "by_width": dict(stats.by_width),
                                 "fallbacks": dict(stats.fallbacks)})

    def _make_room(self, runs: GraphRuns) -> bool:
        """Evict least recently used bindings' graphs until one more fits (rule 2)."""
        while True:
            with self._lock:
                if self.stats.alive < self.stats.cap:
                    return True
                victim_key = next((key for key, entry in self._entries.items()
                                   if entry.runs is not runs), None)
                if victim_key is None:
                    return False
                victim = self._entries.pop(victim_key)
            released = release_graphs(victim.session, tuple(victim.sizes))
            victim.runs.fall_back(EVICTED)
            victim.drop()
            with self._lock:
                self._forgotten(victim)
                self.stats.evictions += released
            logger.debug("evicted CUDA graphs %s (%d bytes)", tuple(victim.sizes),
                         sum(victim.sizes.values()))

    def _forgotten(self, entry: _Entry) -> None:
        self.stats.alive -= len(entry.sizes)
        self.stats.bytes -= sum(entry.sizes.values())
