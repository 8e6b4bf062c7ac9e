"""The inference metadata: the chunked-prefill plan stored in a model's metadata_props.

This module is the only place that knows the keys and the encoding; docs/metadata.md documents
them. Every value is a plain string, so `onnx.load(path).metadata_props` reads it without
onnx-chunk. The passes write one section each; `read_plan` assembles the sections into a
`ChunkPlan` (onnx_chunk.graph.chunk_plan: what the plan says, apart from how it is stored).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.chunk_plan import (
    ChunkPlan,
    KVBinding,
    KVCapacityFindings,
    PaddingEligibility,
    PerTokenFindings,
    RecurrentStateFindings,
    StateBinding,
)

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

SCHEMA_VERSION = 1

CHUNK_SIZE_KEY = "runtime_configurable.chunked_prefill.chunk_size"
LADDER_KEY = "runtime_configurable.chunked_prefill.ladder"
MAX_VARIANTS_KEY = "runtime_configurable.chunked_prefill.max_variants"
SCHEMA_VERSION_KEY = "onnx_chunk.schema_version"
KV_CAPACITY_KEY = "onnx_chunk.kv_capacity"
RECURRENT_STATE_KEY = "onnx_chunk.recurrent_state"
PER_TOKEN_PORTS_KEY = "onnx_chunk.per_token_ports"
PADDING_KEY = "onnx_chunk.padding"
# Written by the concat-KV rewrite only (optional): the longest sequence of a decoder whose
# rotary runs outside GroupQueryAttention, so no cos cache sizes it.
MAX_POSITIONS_KEY = "onnx_chunk.max_positions"
# Written by the query_seqlens pass only (optional): the graph input wired into every
# GroupQueryAttention's `query_seqlens` (native right-padded chunks); absent: not wired.
QUERY_SEQLENS_KEY = "onnx_chunk.query_seqlens"
# Written by the logits rows pass only (optional): the graph input that picks which query rows
# the lm_head computes (`convert --logits-rows`); absent: every row's logits.
LOGITS_ROWS_KEY = "onnx_chunk.logits_rows"

# Written by the KV cache quantization (optional; `convert --kv-dtype`): the cache's element
# type and scale granularity, and what calibration ran on.
KV_CACHE_KEY = "onnx_chunk.kv_cache"
# Written by the int4 re-blocking (optional; `convert --int4-block-size`): the block size the
# 4-bit MatMulNBits weights were quantized to again, and how many nodes that changed.
INT4_BLOCKS_KEY = "onnx_chunk.int4_blocks"
# Written by the int8 matmul rewrite (optional; `convert --int8-matmul`): how many 4-bit
# MatMulNBits became int8 MatMulInteger (per-row activations) and how many stayed 4-bit.
INT8_MATMUL_KEY = "onnx_chunk.int8_matmul"

ALL_KEYS = (
    SCHEMA_VERSION_KEY,
    CHUNK_SIZE_KEY,
    LADDER_KEY,
    MAX_VARIANTS_KEY,
    KV_CAPACITY_KEY,
    RECURRENT_STATE_KEY,
    PER_TOKEN_PORTS_KEY,
    PADDING_KEY,
)


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _set(props: MutableMapping[str, str], key: str, value: str | None) -> bool:
    """Set (or with None remove) one key; return whether anything changed."""
    if value is None:
        return props.pop(key, None) is not None
    if props.get(key) == value:
        return False
    props[key] = value
    return True


def write_kv_capacity(model: ir.Model, findings: KVCapacityFindings) -> bool:
    """Store the KV capacity findings; return whether the metadata changed."""
    value = _encode({
        "gqa_nodes": findings.gqa_nodes,
        "kv_bindings": [dataclasses.asdict(binding) for binding in findings.bindings],
        "max_sequence_length": findings.max_sequence_length,
        "problems": list(findings.problems),
    })
    return _set(model.metadata_props, KV_CAPACITY_KEY, value)


def write_max_positions(model: ir.Model, max_positions: int | None) -> bool:
    """Store (or with None remove) the longest sequence the model supports; return whether the
    metadata changed."""
    return _set(model.metadata_props, MAX_POSITIONS_KEY,
                None if max_positions is None else str(max_positions))


def read_max_positions(model: ir.Model | Mapping[str, str]) -> int | None:
    """The stored longest sequence, or None; ModelStructureError when it is no positive integer."""
    props = _props_of(model)
    if MAX_POSITIONS_KEY not in props:
        return None
    text = props[MAX_POSITIONS_KEY]
    if not text.isdigit() or int(text) < 1:
        raise ModelStructureError(f"metadata key {MAX_POSITIONS_KEY!r} is {text!r}, expected a "
                                  "positive integer; re-run `onnx-chunk convert` on the "
                                  "original model")
    return int(text)


def write_query_seqlens(model: ir.Model, name: str | None) -> bool:
    """Store (or with None remove) the graph input wired into GroupQueryAttention's
    query_seqlens; return whether the metadata changed."""
    return _set(model.metadata_props, QUERY_SEQLENS_KEY, name)


def read_query_seqlens(model: ir.Model | Mapping[str, str]) -> str | None:
    """The stored query_seqlens graph input, or None; ModelStructureError when it is empty."""
    return _input_name(model, QUERY_SEQLENS_KEY)


def _input_name(model: ir.Model | Mapping[str, str], key: str) -> str | None:
    """The graph input name stored under `key`, or None; ModelStructureError when empty."""
    props = _props_of(model)
    if key not in props:
        return None
    name = props[key]
    if not name:
        raise ModelStructureError(f"metadata key {key!r} is empty, expected the name of a graph "
                                  "input; re-run `onnx-chunk convert` on the original model")
    return name


def write_logits_rows(model: ir.Model, name: str | None) -> bool:
    """Store (or with None remove) the graph input choosing the logits rows; return whether
    the metadata changed."""
    return _set(model.metadata_props, LOGITS_ROWS_KEY, name)


def read_logits_rows(model: ir.Model | Mapping[str, str]) -> str | None:
    """The stored logits rows graph input, or None; ModelStructureError when it is empty."""
    return _input_name(model, LOGITS_ROWS_KEY)


@dataclasses.dataclass(frozen=True)
class KVCacheDeclaration:
    """A quantized KV cache: `dtype` "int8" or "int4", `scales` "per-channel" or "per-tensor",
    and the calibration behind the scales (prompts, tokens, source)."""

    dtype: str
    scales: str
    calibration_prompts: int
    calibration_tokens: int
    calibration_source: str


def write_kv_cache(model: ir.Model, declaration: KVCacheDeclaration) -> bool:
    """Store the quantized KV cache declaration; return whether the metadata changed."""
    return _set(model.metadata_props, KV_CACHE_KEY, _encode(dataclasses.asdict(declaration)))


def read_kv_cache(model: ir.Model | Mapping[str, str]) -> KVCacheDeclaration | None:
    """The stored quantized KV cache declaration, or None for a float cache."""
    return _read_section(model, KV_CACHE_KEY, lambda data: KVCacheDeclaration(**data))


@dataclasses.dataclass(frozen=True)
class Int4BlocksDeclaration:
    """Re-blocked 4-bit weights: the `block_size` every 4-bit MatMulNBits has now, how many
    such `nodes` there are, how many the last re-blocking changed and from which block sizes,
    and how many MatMulNBits nodes of other bit widths it left alone."""

    block_size: int
    nodes: int
    reblocked_nodes: int
    source_block_sizes: list[int]
    other_bits_nodes: int


def write_int4_blocks(model: ir.Model, declaration: Int4BlocksDeclaration) -> bool:
    """Store the int4 re-blocking declaration; return whether the metadata changed."""
    return _set(model.metadata_props, INT4_BLOCKS_KEY, _encode(dataclasses.asdict(declaration)))


def read_int4_blocks(model: ir.Model | Mapping[str, str]) -> Int4BlocksDeclaration | None:
    """The stored int4 re-blocking declaration, or None when the weights were not re-blocked."""
    return _read_section(model, INT4_BLOCKS_KEY, lambda data: Int4BlocksDeclaration(**data))


@dataclasses.dataclass(frozen=True)
class Int8MatMulDeclaration:
    """Layers' 4-bit weights rewritten as int8 MatMulInteger: how many nodes were
    rewritten, how many 4-bit MatMulNBits stayed (the lm_head, tied weights), and the bound of
    the int8 weights' codes (None: written before the bound, by an `--int8-matmul` whose
    weights span +-127, which CPUs without VNNI multiply wrongly)."""

    rewritten_nodes: int
    kept_int4_nodes: int
    weight_max: int | None = None


def write_int8_matmul(model: ir.Model, declaration: Int8MatMulDeclaration) -> bool:
    """Store the int8 matmul declaration; return whether the metadata changed."""
    return _set(model.metadata_props, INT8_MATMUL_KEY, _encode(dataclasses.asdict(declaration)))


def read_int8_matmul(model: ir.Model | Mapping[str, str]) -> Int8MatMulDeclaration | None:
    """The stored int8 matmul declaration, or None when the 4-bit weights were not rewritten."""
    return _read_section(model, INT8_MATMUL_KEY, lambda data: Int8MatMulDeclaration(**data))


def write_recurrent_state(model: ir.Model, findings: RecurrentStateFindings) -> bool:
    """Store the recurrent state findings; return whether the metadata changed."""
    value = _encode({
        "state_bindings": [dataclasses.asdict(binding) for binding in findings.bindings],
    })
    return _set(model.metadata_props, RECURRENT_STATE_KEY, value)


def write_per_token_ports(model: ir.Model, findings: PerTokenFindings) -> bool:
    """Store the per-token port findings; return whether the metadata changed."""
    value = _encode({
        "token_input": findings.token_input,
        "per_token_ports": list(findings.ports),
        "position_ids": findings.position_ids,
        "voids": list(findings.voids),
    })
    return _set(model.metadata_props, PER_TOKEN_PORTS_KEY, value)


def write_declaration(
    model: ir.Model,
    *,
    chunk_size: int | None,
    ladder: tuple[int, ...],
    max_variants: int,
    padding: PaddingEligibility,
) -> bool:
    """Store the chunk size, ladder, variant cap, padding verdict and schema version.

    A chunk size of None removes the chunk size and ladder keys. Returns whether the metadata
    changed.
    """
    props = model.metadata_props
    changes = [
        _set(props, SCHEMA_VERSION_KEY, str(SCHEMA_VERSION)),
        _set(props, CHUNK_SIZE_KEY, None if chunk_size is None else str(chunk_size)),
        _set(props, LADDER_KEY, None if chunk_size is None else ",".join(map(str, ladder))),
        _set(props, MAX_VARIANTS_KEY, str(max_variants)),
        _set(props, PADDING_KEY, _encode({"eligible": padding.eligible,
                                          "reasons": list(padding.reasons)})),
    ]
    return any(changes)


def _props_of(model: ir.Model | onnx.ModelProto | Mapping[str, str]) -> Mapping[str, str]:
    # Duck-typed, so that reading a plan (a lean load) imports neither onnx nor onnx_ir.
    if isinstance(model, Mapping):
        return model
    props = model.metadata_props
    if isinstance(props, Mapping):  # onnx_ir's Model
        return props
    return {entry.key: entry.value for entry in props}  # onnx's ModelProto


def _decode(props: Mapping[str, str], key: str) -> Any:
    try:
        return json.loads(props[key])
    except json.JSONDecodeError as error:
        raise ModelStructureError(
            f"metadata key {key!r} is not valid JSON ({error}); re-run `onnx-chunk convert` "
            "on the original model"
        ) from error


def _kv_from(data: Mapping[str, Any]) -> KVCapacityFindings:
    return KVCapacityFindings(
        gqa_nodes=int(data["gqa_nodes"]),
        bindings=tuple(KVBinding(**item) for item in data["kv_bindings"]),
        max_sequence_length=data["max_sequence_length"],
        problems=tuple(data["problems"]),
    )


def _state_from(data: Mapping[str, Any]) -> RecurrentStateFindings:
    return RecurrentStateFindings(
        bindings=tuple(StateBinding(**item) for item in data["state_bindings"]),
    )


def _ports_from(data: Mapping[str, Any]) -> PerTokenFindings:
    return PerTokenFindings(
        token_input=str(data["token_input"]),
        ports=tuple(data["per_token_ports"]),
        position_ids=data["position_ids"],
        voids=tuple(data["voids"]),
    )


def _read_section(model: ir.Model | Mapping[str, str], key: str, build: Any) -> Any:
    props = _props_of(model)
    if key not in props:
        return None
    try:
        return build(_decode(props, key))
    except ModelStructureError:  # _decode's own error (a ValueError too): not re-wrapped
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise ModelStructureError(
            f"metadata key {key!r} is malformed ({type(error).__name__}: {error}); re-run "
            "`onnx-chunk convert` on the original model"
        ) from error


def read_kv_capacity(model: ir.Model | Mapping[str, str]) -> KVCapacityFindings | None:
    """The stored KV capacity findings, or None when the pass has not run."""
    return _read_section(model, KV_CAPACITY_KEY, _kv_from)


def read_recurrent_state(model: ir.Model | Mapping[str, str]) -> RecurrentStateFindings | None:
    """The stored recurrent state findings, or None when the pass has not run."""
    return _read_section(model, RECURRENT_STATE_KEY, _state_from)


def read_per_token_ports(model: ir.Model | Mapping[str, str]) -> PerTokenFindings | None:
    """The stored per-token port findings, or None when the pass has not run."""
    return _read_section(model, PER_TOKEN_PORTS_KEY, _ports_from)


def port_void(name: str, why: str) -> str:
    """The padding reason for an input that voids the padding plan."""
    return f"input {name!r} {why}"


def read_plan(model: ir.Model | onnx.ModelProto | Mapping[str, str]) -> ChunkPlan | None:
    """The plan a converted model declares, or None when the model was never converted.

    Raises ModelStructureError when the metadata is damaged or from a newer schema.
    """
    props = _props_of(model)
    if SCHEMA_VERSION_KEY not in props:
        return None
    try:
        version = int(props[SCHEMA_VERSION_KEY])
    except ValueError as error:
        raise ModelStructureError(
            f"metadata key {SCHEMA_VERSION_KEY!r} is {props[SCHEMA_VERSION_KEY]!r}, expected an "
            "integer; re-run `onnx-chunk convert` on the original model"
        ) from error
    if version != SCHEMA_VERSION:
        raise ModelStructureError(
            f"the model's chunked-prefill metadata has schema version {version}, this onnx-chunk "
            f"reads version {SCHEMA_VERSION}; convert the model again with this version"
        )
    missing = [key for key in ALL_KEYS
               if key not in props and key not in (CHUNK_SIZE_KEY, LADDER_KEY)]
    if missing:
        raise ModelStructureError(
            f"the model's chunked-prefill metadata lacks {', '.join(missing)}; re-run "
            "`onnx-chunk convert` on it"
        )
    kv = read_kv_capacity(props)
    state = read_recurrent_state(props)
    ports = read_per_token_ports(props)
    assert kv is not None and state is not None and ports is not None, \
        "the check for missing keys found their keys"
    try:
        padding = _decode(props, PADDING_KEY)
        chunk_size = int(props[CHUNK_SIZE_KEY]) if CHUNK_SIZE_KEY in props else None
        ladder = (tuple(int(tier) for tier in props[LADDER_KEY].split(",") if tier)
                  if LADDER_KEY in props else ())
        max_variants = int(props[MAX_VARIANTS_KEY])
        eligibility = PaddingEligibility(bool(padding["eligible"]), tuple(padding["reasons"]))
    except ModelStructureError:  # _decode's own error (a ValueError too): not re-wrapped
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise ModelStructureError(
            f"the model's chunked-prefill declaration is malformed ({type(error).__name__}: "
            f"{error}); re-run `onnx-chunk convert` on the original model"
        ) from error
    return ChunkPlan(
        schema_version=version,
        chunk_size=chunk_size,
        ladder=ladder,
        max_variants=max_variants,
        gqa_nodes=kv.gqa_nodes,
        token_input=ports.token_input,
        per_token_ports=ports.ports,
        position_ids=ports.position_ids,
        capacity_inputs=kv.bindings,
        recurrent_state=state.bindings,
        padding=eligibility,
        max_sequence_length=kv.max_sequence_length,
        problems=kv.problems,
        query_seqlens=read_query_seqlens(props),
        logits_rows=read_logits_rows(props),
    )
