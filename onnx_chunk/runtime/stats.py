"""The runtime's readable snapshot (`RuntimeStats`): a plain dataclass, cheap to read, printed
by the CLI. The engine's and the sequences' counters it carries live in engine/counters.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from onnx_chunk.runtime.caches.graph_cache import GraphStats
from onnx_chunk.runtime.caches.variant_cache import CacheStats
from onnx_chunk.runtime.device.transfers import TransferStats
from onnx_chunk.runtime.engine.counters import EngineStats
from onnx_chunk.runtime.engine.sequence_pool import PoolStats


@dataclass(frozen=True)
class RuntimeStats:
    """How a loaded model runs, and its variant cache's counters.

    `weights_bytes`: the model's external weights; `weights_shared`: whether the runtime holds
    them once for all its variants (else its one session loads its own, or, with
    `weights_copied_per_variant`, every CUDA session copies them to the device; either way
    the cache's reading of a session includes its copy); `weights_resident_bytes`: what
    loading the shared weights made the process (CPU) or the device (CUDA) hold.
    `sessions`: ONNX Runtime sessions alive now (created and not yet freed);
    `weights_copies`: copies of the weights held now, on the device and on the host, counted
    from the sessions that own one (a session given shared initializers owns none, unless it
    copies them to its device or pre-packs them) plus the shared host copy (see
    session_factory). `graphs`: the CUDA graphs' counters (planned, alive, captures, replays,
    stranded, bytes; see graph_cache); `graph_widths`: the widths at which graphs were
    captured; `graphs_captured` / `graphs_released`: graphs captured and released so far
    (with their slot, where ONNX Runtime frees them; a graph freed with its session is not
    counted as released),
    `graphs_by_width` the captures per width; `graph_fallbacks`: the widths whose
    capture failed, with the reason (they run without a graph); `transfers`: the bytes
    copied host to device and device to host, and the input synchronisations, of this
    runtime's device (0 on CPU's host path; see device/transfers); `sequences`: the sequence
    pool's counters (buffer sets made, reused, freed, idle); `max_batch`: the batch engine's
    slots, `prefix_reuse` whether its slots keep their prefix for later requests, `engine` its
    counters (None until the first submit); `speculative`: the drafting method
    ("prompt-lookup") or None; `exact`: whether the runtime runs in exact mode (rows
    grouped any way give the same numbers, docs/row_grouping.md). `kv_bytes`: what one
    sequence's KV cache (one engine slot's) holds at the capacity; `kv_dtype`: its element
    type ("float32", "float16", "int8", or "int4" for the packed two-a-byte cache of
    `convert --kv-dtype int4`). `model`: the
    decoder file; `vocab_size`: the logits' width (token ids below it); `eos_token_ids`: the
    ids a generation stops at unless a request names its own.
    """

    provider: str
    device: str
    mask_policy: str
    cuda_graphs: bool
    capacity: int
    chunk_size: int
    ladder: tuple[int, ...]
    specialize: bool | str
    # "native" (right-padded chunks through GroupQueryAttention's query_seqlens), "repeat"
    # (padded rows repeat the last token and are rewound) or "off".
    padding: str
    weights_bytes: int
    sessions_created: int
    cache: CacheStats
    weights_shared: bool = True
    weights_resident_bytes: int | None = None
    weights_copied_per_variant: bool = False
    sessions: int = 0
    weights_copies: int = 0
    graphs: GraphStats = field(default_factory=GraphStats)
    graph_widths: tuple[int, ...] = ()
    graphs_captured: int = 0
    graphs_released: int = 0
    graphs_by_width: dict[int, int] = field(default_factory=dict)
    graph_fallbacks: dict[int | str, str] = field(default_factory=dict)
    transfers: TransferStats = field(default_factory=TransferStats)
    sequences: PoolStats = field(default_factory=PoolStats)
    max_batch: int = 1
    prefix_reuse: bool = True
    engine: EngineStats | None = None
    speculative: str | None = None
    exact: bool = False
    kv_bytes: int = 0
    kv_dtype: str = "float32"
    model: str = ""
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __call__(self) -> RuntimeStats:
        """The stats themselves: `runtime.stats` is a property now, and the old call
        `runtime.stats()` still works while it warns (DeprecationWarning)."""
        warnings.warn("Runtime.stats is a property: read runtime.stats, not runtime.stats()",
                      DeprecationWarning, stacklevel=2)
        return self


def kv_dtype_name(dtypes: Iterable[np.dtype]) -> str:
    """The KV cache's element type as `RuntimeStats.kv_dtype` names it: a uint8 cache is
    GroupQueryAttention's packed int4 (its only uint8 cache), several types are joined by "+".
    """
    names = sorted({"int4" if np.dtype(dtype) == np.uint8 else np.dtype(dtype).name
                    for dtype in dtypes})
    return "+".join(names) if names else "none"
