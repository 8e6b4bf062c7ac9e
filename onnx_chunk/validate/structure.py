"""Structural checks: the ONNX checker, external data, and the chunked-prefill plan.

The plan is re-derived from the graph by running the passes in memory (`analyze`); a converted
model's stored plan must equal it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import onnx

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.external_data import external_data_files
from onnx_chunk.graph.metadata import read_plan
from onnx_chunk.graph.operator_types import type_errors
from onnx_chunk.ladder import DECODE_WIDTH, ladder_tiers
from onnx_chunk.ort_schemas import register_runtime_schemas, runtime_signature
from onnx_chunk.passes import DEFAULT_MAX_VARIANTS, analyze
from onnx_chunk.passes.value_tracing import gqa_nodes, tensor_scatter_nodes
from onnx_chunk.validate.checks import STRUCTURE
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.subject import Subject
from onnx_chunk.validate.timing import Stopwatch

logger = logging.getLogger(__name__)

_NOT_CONVERTED = "not converted; run onnx-chunk convert"


def check_checker(subject: Subject, watch: Stopwatch) -> CheckResult:
    """`onnx.checker` on the file path, so that weights are never loaded into memory.

    The default-domain operators ONNX Runtime registers (onnxruntime-genai's builder writes
    SimplifiedLayerNormalization there) are taught to the checker first, from ONNX Runtime's
    own schemas; any other unknown operator still fails. The declared types are then checked
    against the type rules of ONNX Runtime's schemas, contrib operators included
    (`operator_types.type_errors`), which the checker leaves out: a graph ONNX Runtime refuses
    to load fails here with the node that breaks them.
    """
    runtime_ops = register_runtime_schemas()
    used = sorted({node.op_type for node in subject.model.graph.all_nodes()
                   if node.domain in ("", "ai.onnx") and node.op_type in runtime_ops})
    try:
        onnx.checker.check_model(str(subject.path))
    except (onnx.checker.ValidationError, OSError) as error:
        # the checker's messages run over several lines ("... of node: \nname: X OpType: Y\n
        # is not output of any previous nodes."): one line keeps the node it names
        said = " ".join(str(error).split()) or repr(error)
        return watch.result("checker", Outcome.FAILED, f"onnx.checker: {said}",
                            {"error": str(error)})
    if errors := type_errors(subject.model, runtime_signature):
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return watch.result("checker", Outcome.FAILED,
                            f"ONNX Runtime's type rules: {errors[0]}{more}",
                            {"type_errors": errors})
    if used:
        return watch.result("checker", Outcome.PASSED,
                            f"onnx.checker accepts the model, with ONNX Runtime's schemas for "
                            f"the default-domain {', '.join(used)}", {"runtime_ops": used})
    return watch.result("checker", Outcome.PASSED, "onnx.checker accepts the model")


def check_external_data(subject: Subject, watch: Stopwatch) -> CheckResult:
    if subject.external_data_error is not None:
        return watch.result("external_data", Outcome.FAILED, subject.external_data_error)
    files = sorted(external_data_files(subject.model))
    if not files:
        return watch.result("external_data", Outcome.PASSED,
                            "no external data: every tensor is inside the .onnx file")
    return watch.result("external_data", Outcome.PASSED,
                        f"{len(files)} external data file(s), present and inside the model's "
                        f"folder: {', '.join(files)}", {"files": files})


def structure_checks(subject: Subject, selected: Callable[[str], bool]) -> tuple[
        list[CheckResult], ChunkPlan | None]:
    """Every structure check of a dynamic decoder (unselected ones are left out for the caller
    to report), and the plan analysed from the graph (None when the passes could not run)."""
    watch = Stopwatch(STRUCTURE)
    results: list[CheckResult] = []
    if selected("checker"):
        results.append(check_checker(subject, watch))
    watch.restart()
    if selected("external_data"):
        results.append(check_external_data(subject, watch))
    watch.restart()
    stored, stored_error = _stored_plan(subject)
    max_variants = stored.max_variants if stored is not None else DEFAULT_MAX_VARIANTS
    try:
        analysed: ChunkPlan | None = analyze(subject.model, chunk_size=None,
                                             max_variants=max_variants)
        analysis_error = None
    except (ModelStructureError, ConfigError) as error:
        analysed, analysis_error = None, f"the passes cannot analyse the model: {error}"
    gqa_count = len(gqa_nodes(subject.model.graph))
    scatter_count = len(tensor_scatter_nodes(subject.model.graph))
    checks = {
        "gqa": lambda: _gqa(gqa_count, scatter_count),
        "kv_capacity": lambda: _kv_capacity(analysed, analysis_error, stored, gqa_count,
                                            scatter_count),
        "per_token_ports": lambda: _per_token_ports(analysed, analysis_error),
        "recurrent_state": lambda: _recurrent_state(analysed, analysis_error),
        "padding": lambda: _padding(analysed, analysis_error),
        "metadata": lambda: _metadata(stored, stored_error, analysed, analysis_error),
        "ladder": lambda: _ladder(stored, stored_error),
    }
    for name, check in checks.items():
        watch.restart()
        if selected(name):
            outcome, reason, details = check()
            results.append(watch.result(name, outcome, reason, details))
    return results, analysed


_Verdict = tuple[Outcome, str, dict]


def _stored_plan(subject: Subject) -> tuple[ChunkPlan | None, str | None]:
    try:
        return read_plan(subject.model), None
    except ModelStructureError as error:
        return None, str(error)


def _gqa(count: int, scatter_count: int) -> _Verdict:
    if count == 0 and scatter_count:
        return (Outcome.PASSED, f"{scatter_count} TensorScatter KV write(s) at capacity "
                "(opset 24, `convert --kv-cache onnx24`), no GroupQueryAttention",
                {"gqa_nodes": 0, "tensor_scatter_nodes": scatter_count})
    if count == 0:
        return (Outcome.FAILED, "no com.microsoft::GroupQueryAttention node: KV capacity binding "
                "and chunked prefill with a fixed-shape KV cache do not apply; export the "
                "decoder with GQA (onnxruntime-genai's model builder does)", {})
    return Outcome.PASSED, f"{count} GroupQueryAttention node(s)", {"gqa_nodes": count}


def _kv_capacity(plan: ChunkPlan | None, error: str | None, stored: ChunkPlan | None,
                 gqa_count: int, scatter_count: int) -> _Verdict:
    if plan is None:
        return Outcome.FAILED, str(error), {}
    if gqa_count == 0 and scatter_count == 0:
        return Outcome.SKIPPED, "no GroupQueryAttention node whose KV could be bound", {}
    details = {"kv_bindings": [binding.input for binding in plan.capacity_inputs],
               "problems": list(plan.problems),
               "max_sequence_length": plan.max_sequence_length}
    if plan.problems:
        return Outcome.FAILED, "; ".join(plan.problems), details
    expected = 2 * gqa_count + scatter_count
    if len(plan.capacity_inputs) != expected:
        return (Outcome.FAILED, f"{len(plan.capacity_inputs)} KV inputs can be bound at capacity, "
                f"expected {expected} (past key and value of {gqa_count} GQA nodes, the past "
                f"of {scatter_count} TensorScatter nodes)", details)
    axes = sorted({binding.capacity_axis for binding in plan.capacity_inputs})
    how = "annotated" if stored is not None else "annotatable (not converted yet)"
    limit = (f"max sequence length {plan.max_sequence_length}"
             if plan.max_sequence_length is not None else "max sequence length unknown")
    return (Outcome.PASSED, f"{expected} KV inputs {how} at capacity on axis "
            f"{', '.join(map(str, axes))}, each sharing its present output; {limit}", details)


def _per_token_ports(plan: ChunkPlan | None, error: str | None) -> _Verdict:
    if plan is None:
        return Outcome.FAILED, str(error), {}
    reason = (f"token input {plan.token_input}; per-token ports: "
              f"{', '.join(plan.per_token_ports)}")
    if plan.position_ids:
        reason += f"; position ids: {plan.position_ids}"
    details = {"token_input": plan.token_input, "per_token_ports": list(plan.per_token_ports),
               "position_ids": plan.position_ids}
    return Outcome.PASSED, reason, details


def _recurrent_state(plan: ChunkPlan | None, error: str | None) -> _Verdict:
    if plan is None:
        return Outcome.FAILED, str(error), {}
    details = {"state_bindings": [{"input": binding.input, "output": binding.output,
                                   "detected_by": binding.detected_by}
                                  for binding in plan.recurrent_state]}
    unpaired = [binding.input for binding in plan.recurrent_state if not binding.output]
    if unpaired:
        return (Outcome.FAILED, f"state input(s) {', '.join(unpaired)} have no paired output, so "
                "the state cannot be carried to the next step; export the matching present "
                "output(s)", details)
    if not plan.recurrent_state:
        return Outcome.PASSED, "none", details
    return (Outcome.PASSED, f"{len(plan.recurrent_state)} state input(s) carried step to step: "
            + ", ".join(f"{binding.input} -> {binding.output}"
                        for binding in plan.recurrent_state), details)


def _padding(plan: ChunkPlan | None, error: str | None) -> _Verdict:
    if plan is None:
        return Outcome.FAILED, str(error), {}
    details = {"eligible": plan.padding.eligible, "reasons": list(plan.padding.reasons)}
    if plan.padding.eligible:
        return Outcome.PASSED, "eligible: remainder chunks are padded up the ladder", details
    return (Outcome.PASSED, "not eligible, runs chunked without padding: "
            + "; ".join(plan.padding.reasons), details)


def _metadata(stored: ChunkPlan | None, stored_error: str | None, analysed: ChunkPlan | None,
              analysis_error: str | None) -> _Verdict:
    if stored_error is not None:
        return Outcome.FAILED, stored_error, {}
    if stored is None:
        return Outcome.SKIPPED, _NOT_CONVERTED, {}
    if analysed is None:
        return Outcome.FAILED, str(analysis_error), {}
    stored_json, graph_json = stored.to_json(), analysed.to_json()
    differences = {key: {"stored": stored_json[key], "graph": graph_json[key]}
                   for key in stored_json if stored_json[key] != graph_json[key]}
    if differences:
        listed = "; ".join(f"{key}: stored {value['stored']!r}, the graph gives "
                           f"{value['graph']!r}" for key, value in differences.items())
        return (Outcome.FAILED, f"the stored plan contradicts the graph ({listed}); re-run "
                "onnx-chunk convert on the exported model", {"differences": differences})
    return (Outcome.PASSED, f"schema {stored.schema_version}, consistent with the graph "
            "(the passes re-run in memory give the stored plan)", {})


def _ladder(stored: ChunkPlan | None, stored_error: str | None) -> _Verdict:
    if stored_error is not None:
        return Outcome.SKIPPED, "the stored metadata cannot be read (see structure.metadata)", {}
    if stored is None:
        return Outcome.SKIPPED, _NOT_CONVERTED, {}
    if stored.chunk_size is None:
        return Outcome.SKIPPED, "no chunk size declared; run onnx-chunk convert --chunk-size", {}
    details = {"chunk_size": stored.chunk_size, "ladder": list(stored.ladder),
               "max_variants": stored.max_variants}
    try:
        expected = ladder_tiers(stored.chunk_size, stored.max_variants)
    except ConfigError as error:
        return Outcome.FAILED, f"the declared ladder is impossible: {error}", details
    shapes = len(stored.ladder) + 1
    if shapes > stored.max_variants:
        return (Outcome.FAILED, f"{len(stored.ladder)} tiers plus the decode shape need {shapes} "
                f"variants but the cap is {stored.max_variants}: the cache would thrash; "
                "convert again with a ladder sized from the cap", details)
    if stored.ladder != expected:
        return (Outcome.FAILED, f"the declared ladder {list(stored.ladder)} is not the ladder of "
                f"chunk size {stored.chunk_size} under cap {stored.max_variants} "
                f"({list(expected)}); convert again", details)
    return (Outcome.PASSED, f"tiers {', '.join(map(str, stored.ladder))} plus the decode shape "
            f"({DECODE_WIDTH} row) = {shapes} variants <= cap {stored.max_variants}", details)
