"""The chunked-prefill plan of a decoder, as the passes find it and the runtime reads it.

The sections each pass finds (KV bindings, recurrent state, per-token ports, padding
eligibility), the whole `ChunkPlan`, and the rule that no KV capacity may be below a sliding
window. How the plan is stored in a model's metadata_props is onnx_chunk.graph.metadata's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from onnx_chunk.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KVBinding:
    """A GQA past input bound at physical capacity, and the present output sharing its buffer.

    `kv_heads` and `head_size` are the sizes of axes 1 and 3 as the graph fixes them (builder
    exports declare the head axis symbolic, `kv_cache_dim`); None when nothing in the graph
    says. `window` is the GQA's `local_window_size` when its cache is window-sized
    (`sliding_window_cache=1`: the buffer holds the most recent positions and the operator
    evicts as it fills), else None.
    """

    input: str
    output: str
    capacity_axis: int
    kv_heads: int | None = None
    head_size: int | None = None
    window: int | None = None


@dataclasses.dataclass(frozen=True)
class StateBinding:
    """A recurrent-state input carried to the next step through `output`.

    `detected_by` is "name", "structure" or "name+structure". `output` is empty when the input
    matched a state name template but no graph output pairs with it.
    """

    input: str
    output: str
    detected_by: str


@dataclasses.dataclass(frozen=True)
class PaddingEligibility:
    """Whether query-axis ladder padding is safe for the model, and why not."""

    eligible: bool
    reasons: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class KVCapacityFindings:
    """What the KV capacity pass found: GQA count, capacity bindings, supported length."""

    gqa_nodes: int
    bindings: tuple[KVBinding, ...]
    max_sequence_length: int | None
    problems: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RecurrentStateFindings:
    """What the recurrent state pass found: state inputs carried from step to step."""

    bindings: tuple[StateBinding, ...]


@dataclasses.dataclass(frozen=True)
class PerTokenFindings:
    """What the per-token ports pass found.

    `ports` includes the token input and position_ids; `voids` names every input that makes a
    padding plan impossible.
    """

    token_input: str
    ports: tuple[str, ...]
    position_ids: str | None
    voids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The whole chunked-prefill plan of a decoder."""

    schema_version: int
    chunk_size: int | None
    ladder: tuple[int, ...]
    max_variants: int
    gqa_nodes: int
    token_input: str
    per_token_ports: tuple[str, ...]
    position_ids: str | None
    capacity_inputs: tuple[KVBinding, ...]
    recurrent_state: tuple[StateBinding, ...]
    padding: PaddingEligibility
    max_sequence_length: int | None
    problems: tuple[str, ...]
    # The graph input feeding every GroupQueryAttention's query_seqlens, None when not wired.
    query_seqlens: str | None = None
    # The graph input choosing the logits rows (LogitsRowsPass), None when not wired.
    logits_rows: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (what `onnx-chunk inspect --json` prints)."""
        return {
            "schema_version": self.schema_version,
            "chunk_size": self.chunk_size,
            "ladder": list(self.ladder),
            "max_variants": self.max_variants,
            "gqa_nodes": self.gqa_nodes,
            "token_input": self.token_input,
            "per_token_ports": list(self.per_token_ports),
            "position_ids": self.position_ids,
            "capacity_inputs": [binding.input for binding in self.capacity_inputs],
            "kv_bindings": [dataclasses.asdict(binding) for binding in self.capacity_inputs],
            "recurrent_state": [binding.input for binding in self.recurrent_state],
            "state_bindings": [dataclasses.asdict(binding) for binding in self.recurrent_state],
            "padding": {"eligible": self.padding.eligible, "reasons": list(self.padding.reasons)},
            "max_sequence_length": self.max_sequence_length,
            "problems": list(self.problems),
            "query_seqlens": self.query_seqlens,
            "logits_rows": self.logits_rows,
        }


def widest_window(bindings: Iterable[KVBinding]) -> KVBinding | None:
    """The window-sized KV input of `bindings` with the widest window, or None when no cache
    is window-sized."""
    windowed = [binding for binding in bindings if binding.window is not None]
    return max(windowed, key=lambda binding: binding.window or 0, default=None)


def window_capacity(bindings: Iterable[KVBinding], limit: int | None = None) -> int:
    """The smallest KV capacity that holds every sliding window of `bindings`: the widest
    window, or 0 when no cache is window-sized.

    GroupQueryAttention refuses a window-sized cache (`sliding_window_cache=1`) shorter than
    its window, so no capacity below this runs the model. ConfigError when the model's own
    `limit` (its maximum sequence length) is below it: no capacity can run it.
    """
    binding = widest_window(bindings)
    if binding is None or binding.window is None:
        return 0
    if limit is not None and binding.window > limit:
        raise ConfigError(f"{binding.input!r} keeps a sliding window of {binding.window} "
                          f"positions, which needs a KV capacity of at least {binding.window}, "
                          f"but the model's maximum sequence length is {limit}; re-export it "
                          "with a window no wider than its context")
    return binding.window


def check_window_capacity(bindings: Iterable[KVBinding], capacity: int) -> None:
    """ConfigError when `capacity` is below a sliding window of `bindings` (see
    `window_capacity`)."""
    binding = widest_window(bindings)
    if binding is not None and binding.window is not None and capacity < binding.window:
        raise ConfigError(f"capacity {capacity} is below the sliding window of {binding.window} "
                          f"positions of {binding.input!r}, and a window-sized KV cache cannot "
                          f"be shorter than its window: use a capacity of at least "
                          f"{binding.window} (--capacity)")
