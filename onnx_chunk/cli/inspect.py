"""`onnx-chunk inspect`: print a decoder's chunked-prefill plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from onnx_chunk.cli.json_output import dumps as json_dumps
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.metadata import read_plan
from onnx_chunk.graph.model_folder import locate_model, read_max_positions
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.passes import analyze, find_concat_kv_attention

_LISTED_NAMES = 4


def _names(names: list[str]) -> str:
    """Names joined by commas; long lists keep their ends (`--json` has them all)."""
    if not names:
        return "none"
    if len(names) <= _LISTED_NAMES:
        return ", ".join(names)
    return f"{', '.join(names[:2])}, ... {names[-1]}"


def plan_summary(plan: ChunkPlan) -> list[str]:
    """The plan as short lines for a terminal."""
    if plan.chunk_size is None:
        chunking = "chunk size: not declared (run `onnx-chunk convert`)"
    else:
        chunking = (f"chunk size: {plan.chunk_size}; ladder: "
                    f"{', '.join(map(str, plan.ladder))}; variant cap: {plan.max_variants}")
    capacity = _names([binding.input for binding in plan.capacity_inputs])
    lines = [
        chunking,
        f"GQA nodes: {plan.gqa_nodes}; max sequence length: "
        f"{plan.max_sequence_length if plan.max_sequence_length is not None else 'unknown'}",
        f"capacity inputs ({len(plan.capacity_inputs)}, axis 2): {capacity}",
        f"per-token ports: {', '.join(plan.per_token_ports) or 'none'}"
        + (f" (position ids: {plan.position_ids})" if plan.position_ids else ""),
        "recurrent state: " + (", ".join(f"{binding.input} -> {binding.output or '?'} "
                                         f"({binding.detected_by})"
                                         for binding in plan.recurrent_state) or "none"),
        "padding: " + ("eligible" if plan.padding.eligible else "not eligible"),
    ]
    lines.extend(f"  - {reason}" for reason in plan.padding.reasons)
    problems = [problem for problem in plan.problems if problem not in plan.padding.reasons]
    lines.extend(f"problem: {problem}" for problem in problems)
    return lines


@click.command("inspect")
@click.argument("model_path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(model_path: Path, as_json: bool) -> None:
    """Print the chunked-prefill plan of MODEL_PATH (converted or not).

    For a decoder whose KV grows by Concat, say what the rewrite to GroupQueryAttention found
    (the plan is then the rewritten model's) or why it refuses.
    """
    model_path = locate_model(model_path).onnx_path
    model = load_model(model_path)
    plan = read_plan(model)
    converted = plan is not None
    rewrite = find_concat_kv_attention(model.graph)
    if plan is None:
        plan = analyze(model, max_sequence_length=read_max_positions(model_path.parent))
    if as_json:
        report = {"model": str(model_path), "converted": converted, **plan.to_json()}
        if rewrite.concat_kv:
            report["concat_kv"] = {"rewritable": rewrite.refusal is None,
                                   "refusal": rewrite.refusal,
                                   "layers": [dataclasses.asdict(layer)
                                              for layer in rewrite.layers]}
        click.echo(json_dumps(report, indent=2))
        return
    click.echo(f"{model_path} ({'converted' if converted else 'not converted'})")
    for line in rewrite.summary() + plan_summary(plan):
        click.echo(f"  {line}")
