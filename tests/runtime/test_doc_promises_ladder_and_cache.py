"""docs/ladder_and_cache.md's promises that no other test holds it to."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.ladder import ladder_tiers
from onnx_chunk.runtime.caches.variant_cache import VariantCache

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cache_thrash.py"

# The snapshot's fields, as the page lists them.
SNAPSHOT_FIELDS = ["cap", "meter", "compiles", "hits", "evictions", "waits", "variants",
                   "peak_variants", "widths", "bytes_held", "peak_bytes_held", "variant_bytes",
                   "build_seconds", "growth_readings", "growth_bytes", "padding_refused"]


@given(st.integers(1, 4096), st.integers(2, 12))
def test_the_tiers_are_equally_spaced_up_to_exactly_the_width(width, cap):
    tiers = ladder_tiers(width, cap)
    step = -(-width // (cap - 1))
    assert tiers[-1] == width
    gaps = [b - a for a, b in zip((0, *tiers), tiers)]
    assert all(gap == step for gap in gaps[:-1]) and 0 < gaps[-1] <= step


class _Meter:
    name = "fake"

    def __init__(self) -> None:
        self.value = 0

    def used_bytes(self) -> int:
        return self.value


def test_builds_run_one_at_a_time_and_each_is_charged_its_own_growth():
    meter = _Meter()
    building = []
    overlaps = []
    lock = threading.Lock()

    def build(key):
        with lock:
            building.append(key)
            overlaps.append(len(building))
        meter.value += key * 100
        time.sleep(0.02)
        with lock:
            building.remove(key)
        return key

    cache = VariantCache(build, lambda variant: None, cap=6, meter=meter)
    start = threading.Barrier(5)

    def worker(key):
        start.wait()
        with cache.acquire(key):
            pass

    threads = [threading.Thread(target=worker, args=(key,)) for key in (2, 3, 4, 5, 6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    stats = cache.snapshot()
    assert stats.compiles == 5 and max(overlaps) == 1
    assert stats.variant_bytes == {key: key * 100 for key in (2, 3, 4, 5, 6)}


def test_the_snapshot_has_the_documented_fields():
    cache = VariantCache(lambda key: key, lambda variant: None, cap=2)
    assert [field.name for field in dataclasses.fields(cache.snapshot())] == SNAPSHOT_FIELDS


def test_cache_thrash_gives_the_documented_counts_on_the_tiny_decoder():
    result = subprocess.run([sys.executable, str(SCRIPT), "--new-tokens", "2"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    modes = result.stdout.split("\n== ")[1:]
    assert [mode.split(" (provider")[0] for mode in modes] == [
        "padding off, exact-width keys (per-shape cache)",
        "padding off, ladder keys (a padding-refused model)", "padding on"]

    def built(mode: str) -> list[int]:
        return [int(count) for count in re.findall(r"^pass \d: (\d+) variants built", mode, re.M)]

    def evictions(mode: str) -> int:
        return int(re.search(r"evictions (\d+), peak variants", mode).group(1))

    exact, _, padded = modes
    assert built(exact)[1] == 5 and evictions(exact) > 0
    assert built(padded) == [4, 0] and evictions(padded) == 0
    assert "W=64" in padded and "greedy tokens equal in all three modes: True" in result.stdout
    rows = re.findall(r"^\s+1\s+\d+\s+(\d+)\s+\d+\s+\d+\s+\d+$", padded, re.M)
    remainders = [int(rows_) for rows_ in rows if 1 < int(rows_) < 64]
    assert remainders == [40, 18, 55, 58, 37]
