import gc
import random
import threading
import time
import weakref
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_chunk.errors import ClosedError, ConfigError
from onnx_chunk.ladder import DECODE_WIDTH, ladder_tiers
from onnx_chunk.runtime.caches.variant_cache import (
    DYNAMIC,
    EXACT,
    VariantCache,
    key_label,
    variant_key,
)


class _Variant:
    def __init__(self, key, serial):
        self.key = key
        self.serial = serial
        self.released = False


class _Provider:
    """A fake provider: builds numbered variants, records releases, moves a fake meter."""

    def __init__(self, sizes=None):
        self.sizes = sizes or {}
        self.meter_value = 0
        self.built = []
        self.released = []

    @property
    def name(self):
        return "fake"

    def used_bytes(self):
        return self.meter_value

    def build(self, key):
        variant = _Variant(key, len(self.built))
        self.built.append(variant)
        self.meter_value += self.sizes.get(key, 0)
        return variant

    def release(self, variant):
        assert not variant.released
        variant.released = True
        self.released.append(variant)
        self.meter_value -= self.sizes.get(variant.key, 0)


def _cache(provider, cap=4, metered=True):
    return VariantCache(provider.build, provider.release, cap=cap,
                        meter=provider if metered else None)


def _use(cache, key):
    with cache.acquire(key) as variant:
        assert variant.key == key
        return variant


def test_variant_key_examples():
    tiers = ladder_tiers(512, 4)
    assert [variant_key(w, tiers) for w in (1, 2, 113, 171, 342, 512, 600)] == \
        [1, None, None, 171, 342, 512, None]
    assert variant_key(171, tiers, specialize=False) is DYNAMIC
    assert variant_key(1, tiers, specialize=False) is DYNAMIC
    with pytest.raises(ConfigError):
        variant_key(0, tiers)


@given(st.integers(1, 2048), st.integers(2, 8), st.data())
def test_variant_key_never_leaves_the_ladder(chunk_size, cap, data):
    tiers = ladder_tiers(chunk_size, cap)
    width = data.draw(st.integers(1, chunk_size + 64))
    specialized = variant_key(width, tiers)
    assert specialized in (*tiers, DECODE_WIDTH, DYNAMIC)
    assert (specialized == width) == (width in tiers or width == DECODE_WIDTH)
    assert variant_key(width, tiers, specialize=False) is DYNAMIC
    # The keys a model can ever use fit under a cap of len(tiers) + 2.
    keys = {variant_key(w, tiers) for w in range(1, chunk_size + 65)}
    assert len(keys) <= len(tiers) + 2


def test_hits_compiles_and_widths():
    provider = _Provider()
    cache = _cache(provider)
    for key in (171, 1, 171, DYNAMIC, 1, 171):
        _use(cache, key)
    stats = cache.snapshot()
    assert (stats.compiles, stats.hits, stats.evictions, stats.variants) == (3, 3, 0, 3)
    assert stats.widths == (1, 171, "dynamic")
    assert [v.key for v in provider.built] == [171, 1, DYNAMIC]
    assert provider.released == []
    assert stats.build_seconds > 0


def test_bound_and_lru_order():
    provider = _Provider()
    cache = _cache(provider, cap=3)
    for key in (10, 20, 30):
        _use(cache, key)
    _use(cache, 10)           # 10 becomes the most recently used
    _use(cache, 40)           # evicts 20, the least recently used
    assert [v.key for v in provider.released] == [20]
    _use(cache, 20)           # evicts 30
    _use(cache, 10)           # still live: a hit
    assert [v.key for v in provider.released] == [20, 30]
    stats = cache.snapshot()
    assert (stats.compiles, stats.hits, stats.evictions) == (5, 2, 2)
    assert stats.variants == stats.peak_variants == 3
    assert stats.widths == (10, 20, 30, 40)


def _reference_lru(keys, cap, sizes):
    """What a cap-bounded LRU must do, played without the cache: counters and the live set."""
    live = OrderedDict()
    compiles = hits = evictions = peak_bytes = 0
    for key in keys:
        if key in live:
            hits += 1
            live.move_to_end(key)
            continue
        if len(live) == cap:
            live.popitem(last=False)
            evictions += 1
        live[key] = sizes[key]
        compiles += 1
        peak_bytes = max(peak_bytes, sum(live.values()))
    return compiles, hits, evictions, live, peak_bytes


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.sampled_from([1, 64, 128, 171, 342, 512, None]),
                                   max_size=40))
def test_matches_a_reference_lru_with_byte_accounting(cap, keys):
    sizes = {key: 1000 + 37 * i for i, key in enumerate([1, 64, 128, 171, 342, 512, None])}
    provider = _Provider(sizes)
    cache = _cache(provider, cap=cap)
    for key in keys:
        _use(cache, key)
    compiles, hits, evictions, live, peak_bytes = _reference_lru(keys, cap, sizes)
    stats = cache.snapshot()
    assert (stats.compiles, stats.hits, stats.evictions) == (compiles, hits, evictions)
    assert stats.variants == len(live) <= cap
    assert stats.variant_bytes == {key_label(k): size for k, size in live.items()}
    assert stats.bytes_held == sum(live.values()) == provider.meter_value
    assert stats.peak_bytes_held == peak_bytes
    assert len(provider.released) == evictions
    assert {v.key for v in provider.built if not v.released} == set(live)


def test_without_a_meter_nothing_is_charged():
    provider = _Provider({7: 5000})
    cache = _cache(provider, metered=False)
    _use(cache, 7)
    stats = cache.snapshot()
    assert stats.meter is None
    assert stats.bytes_held == 0 and stats.variant_bytes == {7: 0}


def test_unavailable_reading_is_charged_zero():
    class _Blind:
        name = "blind"

        def used_bytes(self):
            return None

    cache = VariantCache(lambda key: object(), meter=_Blind())
    with cache.acquire(3):
        pass
    stats = cache.snapshot()
    assert stats.meter == "blind" and stats.variant_bytes == {3: 0}


def test_failed_build_frees_its_slot_and_is_retried():
    provider = _Provider()
    failures = {"left": 1}

    def build(key):
        if key == 99 and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("session creation failed")
        return provider.build(key)

    cache = VariantCache(build, provider.release, cap=2)
    _use(cache, 1)
    with pytest.raises(RuntimeError, match="session creation failed"):
        _use(cache, 99)
    assert cache.snapshot().compiles == 1
    _use(cache, 99)            # the slot was given back: no eviction is needed
    stats = cache.snapshot()
    assert (stats.compiles, stats.evictions, stats.variants) == (2, 0, 2)


def test_snapshot_is_a_copy_and_padding_reason_is_kept():
    cache = _cache(_Provider({5: 10}))
    _use(cache, 5)
    cache.note_padding_refused("refused by the model: recurrent state past.0.conv")
    first = cache.snapshot()
    first.variant_bytes[5] = -1
    first.hits = 1000
    second = cache.snapshot()
    assert second.variant_bytes == {5: 10} and second.hits == 0
    assert second.padding_refused == "refused by the model: recurrent state past.0.conv"


def test_clear_releases_idle_variants_only():
    provider = _Provider({1: 10, 2: 20})
    cache = _cache(provider)
    _use(cache, 1)
    with cache.acquire(2) as held:
        assert cache.clear() == 1
        assert not held.released
    assert [v.key for v in provider.released] == [1]
    stats = cache.snapshot()
    assert (stats.variants, stats.bytes_held, stats.evictions) == (1, 20, 0)


def test_bad_cap():
    with pytest.raises(ConfigError):
        VariantCache(lambda key: key, cap=0)


def test_a_thread_holding_a_variant_never_waits_for_itself():
    provider = _Provider()
    cache = _cache(provider, cap=1)
    with cache.acquire(1):
        with cache.acquire(1) as again:   # the same key again is a hit, not a wait
            assert again.key == 1
        with pytest.raises(ConfigError, match="already holds"):
            with cache.acquire(2):
                pass
    _use(cache, 2)                        # once released, the slot is taken over
    assert [v.key for v in provider.released] == [1]


def test_waits_when_every_variant_is_pinned():
    provider = _Provider()
    cache = _cache(provider, cap=2)
    release = {1: threading.Event(), 2: threading.Event()}
    pinned = threading.Barrier(3)
    done = threading.Event()

    def hold(key):
        with cache.acquire(key):
            pinned.wait()
            release[key].wait(5)

    def third():
        _use(cache, 3)
        done.set()

    holders = [threading.Thread(target=hold, args=(key,)) for key in (1, 2)]
    for thread in holders:
        thread.start()
    pinned.wait()
    waiter = threading.Thread(target=third)
    waiter.start()
    deadline = time.monotonic() + 5
    while cache.snapshot().waits == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cache.snapshot().waits >= 1
    assert not done.is_set() and cache.snapshot().variants == 2
    release[2].set()
    assert done.wait(5)
    assert [v.key for v in provider.released] == [2]
    assert cache.snapshot().peak_variants == 2
    release[1].set()
    for thread in (*holders, waiter):
        thread.join(5)


def test_one_build_per_key_under_a_stampede():
    provider = _Provider()

    def slow_build(key):
        time.sleep(0.05)
        return provider.build(key)

    cache = VariantCache(slow_build, provider.release, cap=2)
    start = threading.Barrier(6)

    def worker():
        start.wait()
        _use(cache, 171)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    stats = cache.snapshot()
    assert (stats.compiles, stats.hits) == (1, 5)


def test_no_variant_in_use_is_ever_evicted_under_concurrency():
    cap = 3
    keys = [1, 64, 128, 171, 342, DYNAMIC]
    guard = threading.Lock()
    in_use: dict[int, int] = {}
    live: set[int] = set()
    violations: list[str] = []
    built: list[_Variant] = []

    def build(key):
        with guard:
            if len(live) >= cap:
                violations.append(f"build of {key} with {len(live)} live variants")
            variant = _Variant(key, len(built))
            built.append(variant)
            live.add(variant.serial)
        time.sleep(0.0005)
        return variant

    def release(variant):
        with guard:
            if in_use.get(variant.serial):
                violations.append(f"released variant {variant.key} while in use")
            if variant.released:
                violations.append(f"released variant {variant.key} twice")
            variant.released = True
            live.discard(variant.serial)

    cache = VariantCache(build, release, cap=cap)
    rounds = 150

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(rounds):
            key = rng.choice(keys)
            with cache.acquire(key) as variant:
                with guard:
                    if variant.key != key or variant.released:
                        violations.append(f"got {variant.key} for {key}")
                    in_use[variant.serial] = in_use.get(variant.serial, 0) + 1
                time.sleep(rng.random() * 0.0003)
                with guard:
                    in_use[variant.serial] -= 1

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert violations == []
    stats = cache.snapshot()
    assert stats.hits + stats.compiles == 8 * rounds
    assert stats.compiles == len(built)
    assert stats.compiles - stats.evictions == stats.variants == len(live)
    assert stats.peak_variants <= cap
    assert stats.evictions > 0


@given(st.integers(1, 600))
def test_exact_keys_give_every_width_its_own_variant(width):
    assert variant_key(width, ladder_tiers(512, 4), specialize=EXACT) == width


def test_growth_after_build_is_charged_to_its_variant_once():
    provider = _Provider({1: 100, 16: 40})
    cache = _cache(provider, cap=2)

    def first_run(grow):
        def action():
            provider.meter_value += grow
            return grow
        return action

    with cache.acquire(1) as decode:
        assert cache.measure_growth(1, decode, first_run(30)) == 30
        assert cache.measure_growth(1, decode, first_run(7)) == 7  # measured once only
    stats = cache.snapshot()
    assert stats.variant_bytes == {1: 130}
    assert (stats.bytes_held, stats.growth_readings, stats.growth_bytes) == (130, 1, 30)
    with cache.acquire(16) as prefill:
        cache.measure_growth(16, prefill, first_run(5))
    assert cache.snapshot().variant_bytes == {1: 130, 16: 45}
    # A variant no longer cached (evicted meanwhile) is charged nothing.
    with cache.acquire(32):
        pass
    cache.measure_growth(1, decode, first_run(9))
    stats = cache.snapshot()
    assert 1 not in stats.variant_bytes and stats.growth_readings == 2
    assert stats.bytes_held == sum(stats.variant_bytes.values())


def test_a_pin_released_on_another_thread_is_counted_for_its_owner():
    cache = VariantCache(lambda key: object(), cap=1)
    held = cache.acquire(1)
    held.__enter__()
    closer = threading.Thread(target=held.__exit__, args=(None, None, None))
    closer.start()
    closer.join()
    with cache.acquire(2):  # would raise (this thread "holds" one) if the pin were miscounted
        pass
    assert cache.snapshot().evictions == 1


def test_an_evicted_variant_is_gone_before_its_replacement_builds():
    alive, seen = {}, []

    def build(key):
        seen.append(sorted(k for k, ref in alive.items() if ref() is not None))
        variant = _Variant(key, len(seen))
        alive[key] = weakref.ref(variant)
        return variant

    cache = VariantCache(build, cap=2)
    gc.disable()
    try:
        for key in (5, 7, 9):
            _use(cache, key)
    finally:
        gc.enable()
    assert seen == [[], [5], [7]]


def test_close_releases_idle_variants_now_and_pinned_ones_when_unpinned():
    provider = _Provider()
    cache = _cache(provider)
    _use(cache, 1)
    with cache.acquire(2) as pinned:
        cache.close()
        assert provider.released == provider.built[:1] and not pinned.released
    assert pinned.released and cache.snapshot().variants == 0
    with pytest.raises(ClosedError, match="closed"):
        _use(cache, 1)
    assert cache.snapshot().evictions == 0
