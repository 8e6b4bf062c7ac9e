"""The counters the engine keeps: per prefill chunk, per generation, per sequence and for the
batch engine. Plain dataclasses, cheap to read; `Runtime.stats` and `Sequence.stats` hand them
out (onnx_chunk.runtime exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
