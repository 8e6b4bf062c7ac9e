"""What tests of `onnx-chunk convert`'s weight options read off a converted folder: its prompt
logits and greedy tokens beside the source's, and its greedy tokens from onnx-chunk and from
onnxruntime-genai (the peer venv)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_chunk.passes.int8_matmul import replace_node
from onnx_chunk.runtime import load
from scripts._bench import environment
from scripts._bench.child import run_child


def greedy_tokens_both(folder: Path, peer_python: Path, new_tokens: int = 6,
                       prompt_tokens: int = 40) -> tuple[list[int], list[int]]:
    """(onnx-chunk's, genai's) greedy tokens of one seeded prompt on `folder`, each runtime
    sized to onnx-chunk's capacity, genai without chunking."""
    with load(folder, provider="cpu") as runtime:
        prompt = [(7 * index + 3) % runtime.stats.vocab_size for index in range(prompt_tokens)]
        with runtime.open_sequence() as sequence:
            ours = sequence.generate(prompt, new_tokens)
        capacity = runtime.stats.capacity
    genai = run_child(environment.worker_argv(peer_python, "genai_worker", {
        "model": str(folder), "prompts": [prompt], "new_tokens": new_tokens, "chunk_size": 0,
        "max_length": capacity}), timeout_s=300).payload["results"][0]["tokens"]
    return ours, genai


def logits_and_tokens(folder: Path, new_tokens: int = 8,
                      prompt_tokens: int = 40) -> tuple[np.ndarray, list[int]]:
    """Every row's logits of one seeded prompt and its greedy continuation on `folder` (chunks
    of 32, no end id)."""
    with load(folder, provider="cpu", chunk_size=32) as runtime:
        vocab = runtime.stats.vocab_size
        prompt = [(7 * index + 3) % vocab for index in range(prompt_tokens)]
        with runtime.open_sequence() as sequence:
            logits = sequence.prefill(prompt, all_logits=True)
        with runtime.open_sequence() as sequence:
            tokens = sequence.generate(prompt, new_tokens, eos_token_id=[])
    return logits, tokens



def int8_parts(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Node]:
    """An `--int8-matmul` MatMulInteger's (codes, int8 B, column scales, row scales, last node):
    MatMulInteger -> Cast -> Mul(column scales) -> Mul(row scales)."""
    (cast, _), = node.outputs[0].uses()
    (columns, _), = cast.outputs[0].uses()
    (rows, _), = columns.outputs[0].uses()
    assert (cast.op_type, columns.op_type, rows.op_type) == ("Cast", "Mul", "Mul")
    return node.inputs[0], node.inputs[1], columns.inputs[1], rows.inputs[1], rows


def int8_matmuls(model: ir.Model) -> list[ir.Node]:
    """The MatMulInteger nodes `--int8-matmul` wrote (named as the nodes they replaced)."""
    return [node for node in model.graph if node.op_type == "MatMulInteger"]


def as_fused(model: ir.Model) -> int:
    """Rewrite every int8 matmul of an `--int8-matmul` model (without bias) as the
    MatMulIntegerToFloat that option wrote before: the same codes, B, row and column scales.
    Returns how many were rewritten."""
    graph = model.graph
    rewritten = 0
    for node in int8_matmuls(model):
        codes, weights, columns, rows, last = int8_parts(node)
        zero_point = node.inputs[2]
        fused = ir.node("MatMulIntegerToFloat", [codes, weights, rows, columns, zero_point],
                        domain="com.microsoft", name=node.name)
        replace_node(graph, last, [fused], fused.outputs[0])
        rewritten += 1
    RemoveUnusedNodesPass()(model)
    return rewritten


def as_per_tensor(model: ir.Model) -> int:
    """Rewrite every int8 matmul of an `--int8-matmul` model (without bias) as the
    DynamicQuantizeMatMul that option wrote first: the float activations its per-row
    quantization reads, the same int8 B and column scales, int8 zero points of 0; one scale per
    tensor for the activations. Returns how many nodes were rewritten."""
    graph = model.graph
    rewritten = 0
    for node in int8_matmuls(model):
        codes, weights, scales, _, last = int8_parts(node)
        activations = codes.producer().inputs[0].producer().inputs[0]
        zero_point = ir.Value(name=f"{weights.name}.zero_point", type=ir.TensorType(
            ir.DataType.INT8), shape=ir.Shape([scales.shape[0]]), const_value=ir.tensor(
            np.zeros(scales.shape[0], np.int8), name=f"{weights.name}.zero_point"))
        graph.register_initializer(zero_point)
        replacement = ir.node("DynamicQuantizeMatMul",
                              [activations, weights, scales, zero_point],
                              domain="com.microsoft", name=node.name)
        replace_node(graph, last, [replacement], replacement.outputs[0])
        rewritten += 1
    RemoveUnusedNodesPass()(model)
    return rewritten
