"""Readable counters of the runtime: plain dataclasses, cheap to read, printed by the CLI."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from onnx_chunk.runtime.caches.graph_cache import GraphStats
from onnx_chunk.runtime.caches.variant_cache import CacheStats
from onnx_chunk.runtime.device.transfers import TransferStats
from onnx_chunk.runtime.engine.sequence_pool import PoolStats


@dataclass(frozen=True)
class ChunkRecord:
    """One prefill forward: its real rows, the query width it ran at and how long it took."""

    rows: int
    width: int
    seconds: float


@dataclass
class GenerationStats:
    """One `generate`/`stream` call: prompt, chunks, time to first token and decode speed."""

    prompt_tokens: int
    new_tokens: int = 0
    chunks: list[ChunkRecord] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stopped_by_eos: bool = False

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode steps (the first token comes from the prefill)."""
        steps = self.new_tokens - 1
        if steps < 1 or self.decode_s <= 0.0:
            return None
        return steps / self.decode_s


@dataclass
class SequenceStats:
    """Counters of one sequence since it was opened.

    `decode_forwards` counts plain decode steps and draft verifications; `draft_tokens`: the
    tokens drafted (speculative decoding), `accepted_tokens`: those the verifications kept.
    """

    length: int
    capacity: int
    kv_bytes: int
    prefill_forwards: int = 0
    decode_forwards: int = 0
    padded_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    last_generation: GenerationStats | None = None


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
    ("prompt-lookup") or None. `kv_bytes`: what one sequence's KV cache (one engine slot's)
    holds at the capacity; `kv_dtype`: its element type ("float32", "float16", "int8", or
    "int4" for the packed two-a-byte cache of `convert --kv-dtype int4`). `model`: the
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
    kv_bytes: int = 0
    kv_dtype: str = "float32"
    model: str = ""
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __call__(self) -> RuntimeStats:
        """The stats themselves: `runtime.stats` is a property now, and the old call
        `runtime.stats` still works while it warns (DeprecationWarning)."""
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


@dataclass
class EngineCounters:
    """What the batch engine counts as it runs (see `EngineStats`)."""

    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_chunks: int = 0
    prefill_rows: int = 0
    decode_stalls: int = 0
    longest_decode_gap_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    prefix_hits: int = 0
    prefix_reused_tokens: int = 0
    prefix_refused: int = 0


@dataclass
class EngineStats(EngineCounters):
    """The batch engine's counters (`Runtime.stats.engine`; None before the first submit).

    `slots`: sequences served at once (max_batch); `running`: slots holding a request now;
    `queued`: requests waiting for a slot (at most `queue_limit`); `steps`: engine steps run;
    `decode_steps` / `decode_rows`: batched decode forwards and the rows that really decoded
    in them; `prefill_chunks` / `prefill_rows`: prefill forwards and their real rows;
    `decode_stalls`: steps in which running decodes waited for prefill chunks first;
    `longest_decode_gap_s`: the longest time between two decode forwards while sequences
    were decoding (what a running request sees as its slowest token); `prefill_s` /
    `decode_s`: the time spent in prefill chunks and in batched decode steps (draft
    verifications included); `verify_forwards`: the forwards that verified a row's draft
    (speculative decoding), `draft_tokens` the tokens they verified and `accepted_tokens`
    those kept; `completed`, `cancelled`, `failed`: requests that ended so; `prefix_hits`:
    requests admitted to a slot whose kept prefix they reused, `prefix_reused_tokens` the
    prompt ids not fed again for them; `prefix_refused`: requests whose prompt shared more
    kept ids with their slot than they could reuse (a recurrent state kept for another length,
    a window-sized cache that evicted what the shorter prefix needs).
    """

    slots: int = 0
    running: int = 0
    queued: int = 0
    queue_limit: int = 0

    @property
    def rows_per_decode_step(self) -> float | None:
        """Mean decoding rows per batched decode forward."""
        return self.decode_rows / self.decode_steps if self.decode_steps else None
