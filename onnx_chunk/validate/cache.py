"""Cache behaviour: the same prompt lengths run twice through one runtime, as a server would.

The runtime is the one `serve` loads (sessions and padding as the provider, the environment and
the plan decide), shared with the engine check. The first pass may build variants; the second,
at the same lengths, must build none, and the live variants never exceed the cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.runtime import Runtime
from onnx_chunk.runtime.caches.variant_cache import CacheStats
from onnx_chunk.validate.checks import CACHE
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import Advance, RunSettings, generate_prompt


def cache_checks(runtime: Runtime | OnnxChunkError, settings: RunSettings,
                 selected: Callable[[str], bool], advance: Advance) -> list[CheckResult]:
    """The selected cache checks (second_pass, variant_cap) on the served runtime (or the
    error that loading it raised)."""
    started = time.perf_counter()
    verdicts: dict[str, tuple[Outcome, str, dict]]
    names = [name for name in ("second_pass", "variant_cap") if selected(name)]
    if not names:
        return []
    try:
        if isinstance(runtime, OnnxChunkError):
            raise runtime
        for pass_number in (1, 2):
            for length in settings.lengths:
                generate_prompt(runtime, length, settings)
                advance(f"cache pass {pass_number} {length}")
            if pass_number == 1:
                first = runtime.stats.cache
        second = runtime.stats.cache
    except OnnxChunkError as error:
        verdicts = {name: (Outcome.FAILED, f"the runtime cannot run the model: {error}", {})
                    for name in names}
    else:
        ladder = ", ".join(map(str, runtime.stats.ladder))
        padding = ("padding on" if runtime.stats.padding != "off"
                   else f"padding off: {second.padding_refused}")
        sessions = ("per-width variants" if runtime.stats.specialize is not False
                    else "one shape-generic session, the provider's default")
        context = f"{sessions}, ladder {ladder}, {padding}"
        verdicts = {"second_pass": _second_pass(first, second, context),
                    "variant_cap": _variant_cap(second)}
    seconds = (time.perf_counter() - started) / len(names)
    return [CheckResult(f"{CACHE}.{name}", CACHE, *verdicts[name][:2], seconds,
                        verdicts[name][2]) for name in names]


def _counters(stats: CacheStats) -> dict:
    return {"compiles": stats.compiles, "hits": stats.hits, "evictions": stats.evictions,
            "variants": stats.variants, "peak_variants": stats.peak_variants,
            "widths": list(stats.widths), "cap": stats.cap}


def _second_pass(first: CacheStats, second: CacheStats,
                 context: str) -> tuple[Outcome, str, dict]:
    details = {"first_pass": _counters(first), "after_second_pass": _counters(second)}
    built = second.compiles - first.compiles
    evicted = second.evictions - first.evictions
    widths = ", ".join(map(str, second.widths))
    if built:
        return (Outcome.FAILED, f"the second pass at the same lengths built {built} variant(s) "
                f"and evicted {evicted}: the widths seen ({widths}) do not fit under the cap "
                f"of {second.cap}, so the cache thrashes ({context})", details)
    return (Outcome.PASSED, f"the second pass built no variant ({first.compiles} built in the "
            f"first, widths {widths}; {second.hits - first.hits} hits; {context})", details)


def _variant_cap(stats: CacheStats) -> tuple[Outcome, str, dict]:
    details = _counters(stats)
    if stats.peak_variants > stats.cap:
        return (Outcome.FAILED, f"{stats.peak_variants} variants were live at once, above the "
                f"cap of {stats.cap}", details)
    return (Outcome.PASSED, f"at most {stats.peak_variants} live variant(s) <= cap {stats.cap}",
            details)
