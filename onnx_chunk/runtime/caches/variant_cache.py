"""The bounded, LRU, thread-safe cache of variants: one built session per query-width key.

Why a bounded, shape-keyed cache: a provider builds a variant for every input shape it sees (an
ORT session specialised for one query width; on CUDA one whose graph gets captured), and every
variant keeps memory of its own. Remainder chunks bring a new width per request, so an unbounded
cache grows without end and a bounded one that is smaller than its working set thrashes. The
ladder bounds the working set; this cache bounds what is held and counts what happens:

1. At most `cap` variants are live (built and not yet released), builds in progress included.
2. A miss evicts the least recently used variant that no forward is using, calls `release` on it
   and only then builds the new one.
3. `acquire(key)` pins the variant while a forward runs. A pinned variant is never evicted. When
   the cap is reached and every live variant is pinned, the caller waits until one is unpinned,
   rather than going past the cap.
4. A thread that already pins a variant never waits for a slot (it could wait for itself): it gets
   a ConfigError instead. The runtime holds one variant per forward, and a stream holds its
   decode variant between tokens (see runtime.md, "The decode loop").
5. Builds (and the releases that make room for them) run one at a time, so that each build's
   memory reading (a `MemoryMeter` read before and after) sees that build alone.
6. Every counter is bumped by the event it names: a build, a hit, an eviction, a wait.
7. What a variant allocates after its build (on CUDA the activation arena and CUDA graphs come
   with its first runs) is charged to it by `measure_growth`: a meter reading around an action
   (its first run), taken under the build lock like a build's, added to that variant's bytes.
   Each variant is measured so once; a variant released meanwhile is charged nothing.
8. A pin belongs to the thread that took it (rule 4), even when it is released elsewhere (a
   generator closed by another thread).
9. An evicted variant is released, and no reference to it is left here, before its replacement
   is built: at no moment do cap + 1 variants hold memory.
10. `close` releases every idle variant, and each pinned one as its last pin goes; acquiring
    after it is a ClosedError.

Keys are query widths; None is the shape-generic variant (reported as "dynamic"), which serves
any width that should not get a variant of its own (see `variant_key`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from onnx_chunk.errors import ClosedError, ConfigError
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime.device.memory import MemoryMeter, measured

logger = logging.getLogger(__name__)

V = TypeVar("V")
T = TypeVar("T")

VariantKey = int | None
Specialize = bool | Literal["exact"]
DYNAMIC: VariantKey = None
EXACT = "exact"
DYNAMIC_LABEL = "dynamic"
DEFAULT_CAP = 4


def variant_key(width: int, tiers: Sequence[int], specialize: Specialize = True) -> VariantKey:
    """The cache key a forward at query width `width` runs under.

    Rules:
    1. `specialize=False`: every width shares the shape-generic variant (None).
    2. `specialize="exact"`: every width gets a variant of its own — the naive per-shape cache
       (one variant per width seen), kept to show (and measure) the thrash the ladder prevents.
    3. Otherwise the decode width and the ladder tiers get a variant specialised for their width,
       and any other width (a remainder when padding is refused, an exact width near capacity)
       goes to the shape-generic variant, so widths off the ladder never build new variants.
    """
    if width < 1:
        raise ConfigError(f"a query width must be at least 1, got {width}")
    if specialize == EXACT:
        return width
    if specialize and (width == DECODE_WIDTH or width in tiers):
        return width
    return DYNAMIC


def key_label(key: VariantKey) -> int | str:
    """How a key is reported: its width, or "dynamic" for the shape-generic variant."""
    return DYNAMIC_LABEL if key is None else key


@dataclass
class CacheStats:
    """Counters of a variant cache; every one is bumped by the event it names.

    `widths` lists the distinct keys ever acquired (ints ascending, then "dynamic");
    `variant_bytes` maps each live variant's key label to the bytes its build was measured at
    (0 when no meter is set or the reading was unavailable); `bytes_held` is their sum.
    `growth_readings` counts the readings `measure_growth` took after builds, `growth_bytes`
    what they added (already inside `variant_bytes`).
    `padding_refused` is filled by the runtime with the reason padding is off, if it is.
    """

    cap: int
    meter: str | None = None
    compiles: int = 0
    hits: int = 0
    evictions: int = 0
    waits: int = 0
    variants: int = 0
    peak_variants: int = 0
    widths: tuple[int | str, ...] = ()
    bytes_held: int = 0
    peak_bytes_held: int = 0
    variant_bytes: dict[int | str, int] = field(default_factory=dict)
    build_seconds: float = 0.0
    growth_readings: int = 0
    growth_bytes: int = 0
    padding_refused: str | None = None


@dataclass
class _Entry(Generic[V]):
    variant: V
    size: int
    pins: int = 0
    grown: bool = False


def _release_nothing(variant: object) -> None:
    """The default release: dropping the last reference is all a variant needs."""


class VariantCache(Generic[V]):
    """A bounded LRU cache of variants; see the module docstring for the rules."""

    def __init__(
        self,
        build: Callable[[VariantKey], V],
        release: Callable[[V], None] = _release_nothing,
        *,
        cap: int = DEFAULT_CAP,
        meter: MemoryMeter | None = None,
    ) -> None:
        if cap < 1:
            raise ConfigError(f"the variant cache needs a cap of at least 1, got {cap}")
        self.cap = cap
        self._build = build
        self._release = release
        self._meter = meter
        self._cond = threading.Condition()
        self._build_lock = threading.Lock()
        self._entries: OrderedDict[VariantKey, _Entry[V]] = OrderedDict()
        self._building: set[VariantKey] = set()
        self._pins_by_thread: dict[int, int] = {}
        self._seen: set[VariantKey] = set()
        self._closed = False
        self._stats = CacheStats(cap=cap, meter=None if meter is None else meter.name)

    @contextmanager
    def acquire(self, key: VariantKey) -> Iterator[V]:
        """Pin the variant for `key` (building it on a miss) for the duration of the block."""
        thread = threading.get_ident()
        entry = self._pin(key, thread)
        try:
            yield entry.variant
        finally:
            self._unpin(entry, thread)

    def measure_growth(self, key: VariantKey, variant: V, action: Callable[[], T]) -> T:
        """Run `action` (the variant's first run); charge what the meter grew by to `key`.

        Only the first call for a live variant takes readings (rule 7); later calls, calls
        without a meter and calls for a variant no longer cached just run `action`.
        """
        with self._cond:
            found = self._entries.get(key)
            meter = self._meter
            entry = (found if meter is not None and found is not None
                     and found.variant is variant and not found.grown else None)
            if entry is not None:
                entry.grown = True
        if meter is None or entry is None:
            return action()
        with self._build_lock:
            result, grown = measured(meter, action)
        with self._cond:
            stats = self._stats
            stats.growth_readings += 1
            if grown and self._entries.get(key) is entry:
                entry.size += grown
                stats.growth_bytes += grown
                stats.variant_bytes[key_label(key)] = entry.size
                stats.bytes_held += grown
                stats.peak_bytes_held = max(stats.peak_bytes_held, stats.bytes_held)
        logger.debug("variant %s grew by %s bytes on its first run", key_label(key),
                     "unmeasured" if grown is None else grown)
        return result

    def snapshot(self) -> CacheStats:
        """A copy of the counters, consistent at one instant."""
        with self._cond:
            return dataclasses.replace(self._stats,
                                       variant_bytes=dict(self._stats.variant_bytes))

    def note_padding_refused(self, reason: str | None) -> None:
        """Record why padding is off for the model this cache serves (None: it is on)."""
        with self._cond:
            self._stats.padding_refused = reason

    def clear(self) -> int:
        """Release every variant no forward is using; returns how many were released.

        Not counted as evictions: nothing asked for the room.
        """
        with self._cond:
            idle = [key for key, entry in self._entries.items() if entry.pins == 0]
            released = [self._drop(key) for key in idle]
            self._cond.notify_all()
        with self._build_lock:
            for entry in released:
                self._release(entry.variant)
        return len(released)

    def close(self) -> None:
        """Release every variant now idle and each pinned one when unpinned (rule 10)."""
        with self._cond:
            self._closed = True
        self.clear()

    def _pin(self, key: VariantKey, thread: int) -> _Entry[V]:
        with self._cond:
            if self._closed:
                raise ClosedError("the runtime was closed; load the model again to run it")
            if key not in self._seen:
                self._seen.add(key)
                self._stats.widths = _labels(self._seen)
            while True:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.pins += 1
                    self._entries.move_to_end(key)
                    self._stats.hits += 1
                    self._count_pin(thread, 1)
                    return entry
                if key not in self._building:
                    # The victim is held by this list alone, which the build empties (rule 9).
                    victims: list[_Entry[V]] = []
                    if len(self._entries) + len(self._building) < self.cap:
                        break
                    # Wrapped in a 1-tuple: the dynamic variant's key is None itself.
                    victim = next(((k,) for k, e in self._entries.items() if e.pins == 0),
                                  None)
                    if victim is not None:
                        (victim_key,) = victim
                        victims.append(self._drop(victim_key))
                        self._stats.evictions += 1
                        logger.debug("evicting variant %s (%d bytes)",
                                     key_label(victim_key), victims[0].size)
                        break
                    if self._pins_by_thread.get(thread):
                        raise ConfigError(
                            f"all {self.cap} variants are in use and this thread already holds "
                            f"one, so waiting for a slot for width {key_label(key)} could wait "
                            "forever; release the held variant before acquiring another, or "
                            "raise the variant cap")
                    self._stats.waits += 1
                self._cond.wait()
                if self._closed:
                    raise ClosedError("the runtime was closed; load the model again to run it")
            self._building.add(key)
        return self._build_pinned(key, victims, thread)

    def _build_pinned(self, key: VariantKey, victims: list[_Entry[V]],
                      thread: int) -> _Entry[V]:
        try:
            with self._build_lock:
                while victims:
                    self._release(victims.pop().variant)
                start = time.perf_counter()
                if self._meter is None:
                    variant, size = self._build(key), None
                else:
                    variant, size = measured(self._meter, lambda: self._build(key))
                seconds = time.perf_counter() - start
        except BaseException:
            with self._cond:
                self._building.discard(key)
                self._cond.notify_all()
            raise
        entry = _Entry(variant, size or 0, pins=1)
        with self._cond:
            self._building.discard(key)
            self._entries[key] = entry
            stats = self._stats
            stats.compiles += 1
            stats.build_seconds += seconds
            stats.variants = len(self._entries)
            stats.peak_variants = max(stats.peak_variants, stats.variants)
            stats.variant_bytes[key_label(key)] = entry.size
            stats.bytes_held += entry.size
            stats.peak_bytes_held = max(stats.peak_bytes_held, stats.bytes_held)
            self._count_pin(thread, 1)
            self._cond.notify_all()
        logger.debug("built variant %s in %.3f s (%s bytes)", key_label(key), seconds,
                     "unmeasured" if size is None else size)
        return entry

    def _unpin(self, entry: _Entry[V], thread: int) -> None:
        with self._cond:
            entry.pins -= 1
            self._count_pin(thread, -1)
            if entry.pins == 0:
                self._cond.notify_all()
            closing = self._closed and entry.pins == 0
        if closing:
            self.clear()

    def _drop(self, key: VariantKey) -> _Entry[V]:
        entry = self._entries.pop(key)
        stats = self._stats
        stats.variants = len(self._entries)
        stats.bytes_held -= entry.size
        del stats.variant_bytes[key_label(key)]
        return entry

    def _count_pin(self, thread: int, delta: int) -> None:
        held = self._pins_by_thread.get(thread, 0) + delta
        if held:
            self._pins_by_thread[thread] = held
        else:
            self._pins_by_thread.pop(thread, None)


def _labels(keys: set[VariantKey]) -> tuple[int | str, ...]:
    widths: list[int | str] = sorted(key for key in keys if key is not None)
    if DYNAMIC in keys:
        widths.append(DYNAMIC_LABEL)
    return tuple(widths)
