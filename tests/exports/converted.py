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



def as_per_tensor(model: ir.Model) -> int:
    """Rewrite every MatMulIntegerToFloat of an `--int8-matmul` model (without bias) as the
    DynamicQuantizeMatMul that option wrote before: the float activations its per-row
    quantization reads, the same int8 B and column scales, int8 zero points of 0; one scale per
    tensor for the activations. Returns how many nodes were rewritten."""
    graph = model.graph
    rewritten = 0
    for node in [node for node in graph if node.op_type == "MatMulIntegerToFloat"]:
        activations = node.inputs[0].producer().inputs[0].producer().inputs[0]
        weights, scales = node.inputs[1], node.inputs[3]
        zero_point = ir.Value(name=f"{weights.name}.zero_point", type=ir.TensorType(
            ir.DataType.INT8), shape=ir.Shape([scales.shape[0]]), const_value=ir.tensor(
            np.zeros(scales.shape[0], np.int8), name=f"{weights.name}.zero_point"))
        graph.register_initializer(zero_point)
        replacement = ir.node("DynamicQuantizeMatMul",
                              [activations, weights, scales, zero_point],
                              domain="com.microsoft", name=node.name)
        replace_node(graph, node, [replacement], replacement.outputs[0])
        rewritten += 1
    RemoveUnusedNodesPass()(model)
    return rewritten
