"""Declare the chunk size, its ladder, the variant cap and the padding verdict in the metadata."""

from __future__ import annotations

import logging

import onnx_ir as ir

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.ladder import ladder_tiers
from onnx_chunk.passes.preconditions import precondition

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 512
DEFAULT_MAX_VARIANTS = 4


class ChunkedPrefillDeclarationPass(ir.passes.InPlacePass):
    """Write `runtime_configurable.chunked_prefill.*` and the padding verdict.

    Rules:
    1. Runs after the KV capacity, recurrent state and per-token ports passes and reads their
       findings from the metadata; without them it refuses to run.
    2. The chunk size is the one given; None keeps the chunk size the model already declares
       (an unconverted model then declares none, and has no ladder), refused when it is no
       positive integer.
    3. The ladder is `ladder_tiers(chunk_size, max_variants)`.
    4. Padding is eligible only when the model has GQA nodes, every GQA past is bound at
       capacity without problems, no KV cache is window-sized (it evicts as it fills) unless
       the query_seqlens pass wired GQA's `query_seqlens` (padded rows then never enter the
       cache), no recurrent state exists and no input voids the plan; each failed condition
       is one reason.
    5. The pass reports a modification only when the declaration differs from what is stored.
    """

    def __init__(self, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                 max_variants: int = DEFAULT_MAX_VARIANTS) -> None:
        super().__init__()
        if chunk_size is not None:
            ladder_tiers(chunk_size, max_variants)
        self.chunk_size = chunk_size
        self.max_variants = max_variants

    def requires(self, model: ir.Model) -> None:
        missing = [name for name, section in (
            ("kv capacity", metadata.read_kv_capacity(model)),
            ("recurrent state", metadata.read_recurrent_state(model)),
            ("per-token ports", metadata.read_per_token_ports(model)),
        ) if section is None]
        if missing:
            raise ir.passes.PreconditionError(
                f"the declaration needs the findings of the {', '.join(missing)} pass(es); "
                "run the whole pipeline (onnx_chunk.passes.convert_model)"
            )
        if self.chunk_size is None:
            with precondition():
                _declared_chunk_size(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        kv = metadata.read_kv_capacity(model)
        state = metadata.read_recurrent_state(model)
        ports = metadata.read_per_token_ports(model)
        assert kv is not None and state is not None and ports is not None, "requires() checked it"
        chunk_size = self.chunk_size
        if chunk_size is None:
            chunk_size = _declared_chunk_size(model)
        ladder = ladder_tiers(chunk_size, self.max_variants) if chunk_size is not None else ()
        if (chunk_size is not None and kv.max_sequence_length is not None
                and chunk_size > kv.max_sequence_length):
            logger.warning("chunk size %d exceeds the model's maximum sequence length %d; "
                           "no chunk will ever be full", chunk_size, kv.max_sequence_length)
        padding = padding_eligibility(kv, state, ports,
                                      native=metadata.read_query_seqlens(model) is not None)
        modified = metadata.write_declaration(
            model,
            chunk_size=chunk_size,
            ladder=ladder,
            max_variants=self.max_variants,
            padding=padding,
        )
        if modified:
            logger.info("declared chunk size %s, ladder %s, cap %d variants, padding %s",
                        chunk_size, list(ladder), self.max_variants,
                        "eligible" if padding.eligible else "not eligible")
        return ir.passes.PassResult(model, modified=modified)


def _declared_chunk_size(model: ir.Model) -> int | None:
    declared = model.metadata_props.get(metadata.CHUNK_SIZE_KEY)
    if declared is None:
        return None
    if not declared.isdigit() or int(declared) < 1:
        raise ModelStructureError(
            f"the model declares {metadata.CHUNK_SIZE_KEY} = {declared!r}, expected a positive "
            "integer; convert it again with --chunk-size"
        )
    return int(declared)


def padding_eligibility(
    kv: chunk_plan.KVCapacityFindings,
    state: chunk_plan.RecurrentStateFindings,
    ports: chunk_plan.PerTokenFindings,
    native: bool = False,
) -> chunk_plan.PaddingEligibility:
    """The padding verdict the findings of the three analysis passes imply (`native`: GQA
    takes query_seqlens, so padded rows never reach a KV cache)."""
    reasons: list[str] = []
    if kv.gqa_nodes == 0 and not kv.bindings:
        reasons.append("the model has no com.microsoft::GroupQueryAttention node, so its KV "
                       "cache is not bound at capacity and padded rows could not be rewound")
    reasons.extend(kv.problems)
    windowed = [binding.input for binding in kv.bindings if binding.window is not None]
    if windowed and not native:
        reasons.append(f"{len(windowed)} KV input(s) ({windowed[0]!r} first) hold a window-sized "
                       "cache that evicts as it fills (sliding_window_cache), so padded rows "
                       "could evict positions the next chunk still reads")
    for binding in state.bindings:
        reasons.append(f"recurrent state {binding.input!r} (found by {binding.detected_by}) "
                       "advances with every row and has no logical length to rewind, so a "
                       "padded row could never be taken back")
    reasons.extend(ports.voids)
    return chunk_plan.PaddingEligibility(eligible=not reasons, reasons=tuple(reasons))
