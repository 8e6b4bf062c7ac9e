"""Rewrite 4-bit MatMulNBits as int8 DynamicQuantizeMatMul (`convert --int8-matmul`).

ONNX Runtime's CPU MatMulNBits computes a prefill's rows with its int8 kernel at a fraction of
what the CPU's int8 units can do (on AVX-512 VNNI block 32 ran at 14-16% of the measured roof,
issue #34), while its QGEMM (MLAS `MlasGemmU8S8`: AVX2, AVX-512 VNNI and, where the CPU has
it, AMX tiles, `qgemm_kernel_amx.cpp`) runs the same multiply-adds several times faster. This
pass gives the layers' weights to that kernel: each 4-bit node's weights are dequantized
exactly and quantized again to int8, one scale per output column, for the CPU provider's
`com.microsoft::DynamicQuantizeMatMul` (A float32, quantized per tensor at run time; B int8;
ONNX Runtime registers it for the CPU provider only). The weights take twice the bytes of the
4-bit ones, and the logits move (int8 weights and per-tensor uint8 activations in place of
4-bit weights and per-block int8 activations). They are written to a data file of their own
beside the model (`model_io.write_to_data_file`): ONNX Runtime maps them and unmaps each once
MLAS has packed it, where weights inside the .onnx stayed resident beside the packed copy.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from onnx_chunk import metadata
from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.model_io import write_to_data_file
from onnx_chunk.passes.int4_blocks import (
    Int4MatMul,
    dequantize_int4,
    find_int4_matmuls,
)
from onnx_chunk.passes.logits_rows import find_lm_head
from onnx_chunk.passes.value_tracing import MICROSOFT_DOMAIN, input_at

logger = logging.getLogger(__name__)

DYNAMIC_QUANTIZE_MATMUL = "DynamicQuantizeMatMul"
OPTION = "--int8-matmul"
_BIAS_INPUT = 5
_INT8_MAX = 127.0


def int8_targets(model: ir.Model) -> tuple[list[Int4MatMul], int]:
    """The 4-bit MatMulNBits nodes the pass rewrites, and how many 4-bit nodes it keeps (rules
    1-3); ConfigError or ModelStructureError when the model cannot be rewritten."""
    graph = model.graph
    matmuls, _ = find_int4_matmuls(graph, OPTION)
    if not matmuls:
        raise ConfigError("--int8-matmul rewrites 4-bit com.microsoft::MatMulNBits, and the "
                          "model has none (its weights are not INT4); convert without it")
    head = _lm_head(graph)
    targets = [matmul for matmul in matmuls
               if matmul.node is not head and _read_by_one(matmul)]
    for matmul in targets:
        activations = input_at(matmul.node, 0)
        if activations is None or activations.dtype != ir.DataType.FLOAT:
            raise ModelStructureError(
                f"MatMulNBits {matmul.node.name!r} computes in "
                f"{None if activations is None else activations.dtype}; DynamicQuantizeMatMul "
                "takes float32 activations only (a CPU export); convert without --int8-matmul")
    return targets, len(matmuls) - len(targets)


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    try:
        return find_lm_head(graph)[0]
    except ModelStructureError:
        return None


def _read_by_one(matmul: Int4MatMul) -> bool:
    """Whether the node's weights are read by this node alone (a tied embedding's are not)."""
    return all(len(value.uses()) == 1
               for value in (matmul.packed, matmul.scales, matmul.zero_points)
               if value is not None)


def quantize_int8_columns(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float weights -> (B int8 [K, N], scale float32 [N]): symmetric, one scale per
    output column, max |w| / 127 (a zero column gets scale 1 and zeros)."""
    peak = np.abs(weights).max(axis=1).astype(np.float32)
    scale = np.where(peak > 0, peak / _INT8_MAX, 1.0).astype(np.float32)
    codes = np.clip(np.rint(weights / scale[:, None]), -_INT8_MAX, _INT8_MAX).astype(np.int8)
    return np.ascontiguousarray(codes.T), scale


class Int8MatMulPass(ir.passes.InPlacePass):
    """Rewrite the layers' 4-bit MatMulNBits as int8 DynamicQuantizeMatMul (module docstring).

    Rules:
    1. A model without a 4-bit `com.microsoft::MatMulNBits` is refused (ConfigError naming
       the option); a 4-bit node whose weights cannot be read exactly is refused as
       `--int4-block-size` refuses it (int4_blocks rule 2).
    2. Kept 4-bit: the lm_head (logits_rows' `find_lm_head`: with last-row logits it computes
       one row per forward, and it is the largest matrix) and a node whose weights another node
       also reads (an lm_head tied to a GatherBlockQuantized embedding).
    3. A node to rewrite must take float32 activations (DynamicQuantizeMatMul's only type):
       otherwise ModelStructureError naming it. The int8 weights are held in memory until the
       model is saved, then written to a data file beside it (`model_io.write_to_data_file`).
    4. Each other node becomes `DynamicQuantizeMatMul(A, B, b_scale, b_zero_point, bias)` with
       the same name and output: B int8 [K, N] and b_scale float32 [N] from
       `quantize_int8_columns` of the exact dequantized weights (`dequantize_int4`),
       b_zero_point int8 zeros [N], the bias (MatMulNBits input 5) where it had one. Its 4-bit
       initializers are removed.
    5. The metadata (`onnx_chunk.int8_matmul`) records the nodes rewritten and kept; running
       the pass again reports `modified=False`.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        previous = metadata.read_int8_matmul(model)
        try:
            targets, kept = int8_targets(model)
        except ConfigError:
            if previous is not None:  # rewritten before: only kept nodes, or none, remain
                return ir.passes.PassResult(model, modified=False)
            raise
        if not targets and previous is not None:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        for matmul in targets:
            self._rewrite(graph, matmul)
        done = len(targets) + (0 if previous is None else previous.rewritten_nodes)
        metadata.write_int8_matmul(model, metadata.Int8MatMulDeclaration(
            rewritten_nodes=done, kept_int4_nodes=kept))
        logger.info("int8 matmul: %d 4-bit MatMulNBits nodes rewritten, %d kept",
                    len(targets), kept)
        return ir.passes.PassResult(model, modified=bool(targets))

    def _rewrite(self, graph: ir.Graph, matmul: Int4MatMul) -> None:
        """Rule 4 for one node."""
        node = matmul.node
        assert matmul.packed.const_value is not None and matmul.scales.const_value is not None
        zero_points = (None if matmul.zero_points is None or matmul.zero_points.const_value is None
                       else matmul.zero_points.const_value.numpy())
        weights = dequantize_int4(matmul.packed.const_value.numpy(),
                                  matmul.scales.const_value.numpy(), zero_points, matmul.k,
                                  matmul.block_size).astype(np.float32)
        codes, scale = quantize_int8_columns(weights)
        name = node.name or (matmul.packed.name or "matmul")
        values = [self._initializer(graph, f"{name}.int8.{suffix}", array) for suffix, array in
                  (("B", codes), ("scale", scale), ("zero_point", np.zeros(matmul.n, np.int8)))]
        inputs = [input_at(node, 0), *values, input_at(node, _BIAS_INPUT)]
        if inputs[-1] is None:
            inputs.pop()
        replacement = ir.Node(MICROSOFT_DOMAIN, DYNAMIC_QUANTIZE_MATMUL, inputs,
                              num_outputs=1, name=node.name)
        output, new_output = node.outputs[0], replacement.outputs[0]
        new_output.name, new_output.shape, new_output.type = (output.name, output.shape,
                                                              output.type)
        graph.insert_before(node, replacement)
        ir.convenience.replace_all_uses_with(output, new_output)
        if output in graph.outputs:
            graph.outputs[graph.outputs.index(output)] = new_output
        graph.remove(node, safe=True)
        for old in (matmul.packed, matmul.scales, matmul.zero_points):
            if (old is not None and old.name is not None and old.name in graph.initializers
                    and not old.uses()):
                graph.initializers.pop(old.name)

    @staticmethod
    def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
        if name in graph.initializers:
            raise ModelStructureError(f"the model already has an initializer {name!r}, the "
                                      "name --int8-matmul gives a rewritten weight; rename it")
        value = ir.Value(name=name, shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         const_value=ir.tensor(array, name=name))
        graph.register_initializer(value)
        return write_to_data_file(value)

