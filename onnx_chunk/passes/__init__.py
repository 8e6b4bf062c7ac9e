"""The graph passes that prepare a decoder for chunked prefill, and the pipeline that runs them.

Each pass records its findings in the inference metadata (`onnx_chunk.metadata`); the last one
turns them into the declaration the runtime reads. Weights are never read: the passes look at
graph structure, shapes and initializer shapes only.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk import metadata
from onnx_chunk.errors import ModelStructureError
from onnx_chunk.passes.chunked_prefill_declaration import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_VARIANTS,
    ChunkedPrefillDeclarationPass,
)
from onnx_chunk.passes.kv_capacity import KVCapacityPass
from onnx_chunk.passes.per_token_ports import PerTokenPortsPass
from onnx_chunk.passes.recurrent_state import RecurrentStatePass
from onnx_chunk.passes.supported_opsets import check_supported_opsets
from onnx_chunk.passes.value_tracing import gqa_nodes

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_VARIANTS",
    "ChunkedPrefillDeclarationPass",
    "KVCapacityPass",
    "PerTokenPortsPass",
    "RecurrentStatePass",
    "analyze",
    "convert_model",
]

def _run_pipeline(model: ir.Model, chunk_size: int | None,
                  max_variants: int) -> ir.passes.PassResult:
    # Order matters: the per-token ports pass reads the recurrent state findings, and the
    # declaration reads all three; each checks that its inputs are in the metadata.
    passes = (
        KVCapacityPass(),
        RecurrentStatePass(),
        PerTokenPortsPass(),
        ChunkedPrefillDeclarationPass(chunk_size=chunk_size, max_variants=max_variants),
    )
    modified = False
    for pass_ in passes:
        modified = pass_(model).modified or modified
    return ir.passes.PassResult(model, modified=modified)


def analyze(model: ir.Model, *, chunk_size: int | None = None,
            max_variants: int = DEFAULT_MAX_VARIANTS) -> metadata.ChunkPlan:
    """The plan the pipeline would write, leaving the model's metadata as it was.

    With `chunk_size` None the plan keeps the chunk size the model declares (none for an
    unconverted model). Raises ModelStructureError for opsets or domains ORT cannot run.
    """
    check_supported_opsets(model)
    saved = dict(model.metadata_props)
    try:
        _run_pipeline(model, chunk_size, max_variants)
        plan = metadata.read_plan(model)
    finally:
        model.metadata_props.clear()
        model.metadata_props.update(saved)
    assert plan is not None, "the declaration pass always writes the schema version"
    return plan


def convert_model(model: ir.Model, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  max_variants: int = DEFAULT_MAX_VARIANTS) -> ir.passes.PassResult:
    """Run the pipeline in place; `modified` is False when the model was already converted so.

    Raises ModelStructureError for a model without GroupQueryAttention (KV capacity annotation
    does not apply to it) or with opsets or domains ORT cannot run, and ConfigError for an
    impossible chunk size or variant cap.
    """
    check_supported_opsets(model)
    if not gqa_nodes(model.graph):
        raise ModelStructureError(
            "the model has no com.microsoft::GroupQueryAttention node, so KV capacity "
            "annotation does not apply; the runtime can still run it with whole-prompt prefill "
            "and a growing KV cache, without chunked-prefill padding or capacity binding"
        )
    return _run_pipeline(model, chunk_size, max_variants)
