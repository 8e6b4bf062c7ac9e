"""Rewrite 4-bit MatMulNBits as int8 matmuls with one activation scale per row (`convert
--int8-matmul`, and `convert`'s default for a CPU export: `default_refusal`).

ONNX Runtime's CPU MatMulNBits computes a prefill's rows with its int8 kernel at a fraction of
what the CPU's int8 units can do, while its QGEMM (MLAS `MlasGemm` U8S8: AVX2, AVX-512 VNNI,
AMX where the CPU has it) runs the same multiply-adds several times faster. This pass gives the
layers' weights to that kernel: each 4-bit node's weights are dequantized exactly and quantized
again to int8, one scale per output column, for ONNX's `MatMulInteger`.

Its activations are quantized in the graph, one symmetric scale per row (max |a| / 127 of that
row), so a row's result depends on that row's values alone: what a request computes does not
depend on the other requests batched beside it. `DynamicQuantizeMatMul`, which this option
wrote first, quantizes the whole tensor with one scale, so one row's outliers moved every other
row's result (`engine.batched_decode` of `validate` failed on it); the pass rewrites such nodes
of a folder it converted before, and the `com.microsoft::MatMulIntegerToFloat` it wrote next
(the same numbers, one fused kernel) too. The exact int32 product is scaled by standard nodes:
Cast to float, times the column scales, times the row scale, in that order; that is what
MatMulIntegerToFloat computes (`ScaleOutput` in
onnxruntime/contrib_ops/cpu/quantization/dynamic_quantize_matmul.cc), bit for bit at every row
count (tests/passes/test_int8_matmul.py), and it decodes faster: on qwen05-int4, Xeon without
AMX, 7.7% at one row, a 1000-token prefill within 2% (docs/benchmarks.md, section 9). Both run
the same QGEMM kernel (MLAS's one-row GEMV path wants zero points of 0, `MlasGemmQuantOperation`
in qgemm.h, and these codes have 128), so the difference is in what the fused kernel does
around it; where exactly was not pinned down. MatMulNBits with 8-bit weights is also
row-independent but prefills no faster than the 4-bit default.

The weights take twice the bytes of the 4-bit ones and the logits move (int8 weights and
per-row int8 activations in place of 4-bit weights and per-block int8 activations). They are
written to a data file beside the model (`model_io.write_to_data_file`): ONNX Runtime maps them
and unmaps each once MLAS has packed it.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import write_to_data_file
from onnx_chunk.passes.int4_blocks import (
    Int4MatMul,
    dequantize_int4,
    find_int4_matmuls,
    is_int4_matmul,
)
from onnx_chunk.passes.logits_rows import find_lm_head
from onnx_chunk.passes.preconditions import precondition
from onnx_chunk.passes.value_tracing import MICROSOFT_DOMAIN, input_at, name_of

logger = logging.getLogger(__name__)

MATMUL_INTEGER = "MatMulInteger"
MATMUL_INTEGER_TO_FLOAT = "MatMulIntegerToFloat"
DYNAMIC_QUANTIZE_MATMUL = "DynamicQuantizeMatMul"
OPTION = "--int8-matmul"
# The name prefix of the nodes and constants the per-row quantization adds.
ROW_PREFIX = "int8_rows"
_NBITS_BIAS_INPUT = 5
_DQMM_B, _DQMM_SCALE, _DQMM_ZERO_POINT, _DQMM_BIAS = 1, 2, 3, 4
_MITF_B, _MITF_ROW_SCALE, _MITF_B_SCALE, _MITF_BIAS = 1, 2, 3, 6
_INT8_MAX = 127.0
# The weights' codes stay within +-64 (7 bits and a sign). MLAS's U8S8 kernels for CPUs without
# VNNI (AVX2, AVX-512 BW) multiply with vpmaddubsw, which adds each pair of uint8 x int8
# products into an int16 with saturation: uint8 codes reach 255 (zero point 128), so 8-bit
# weights clip pairs up to 2 x 255 x 127 = 64770 against 32767, and the product is wrong there
# (measured: Haswell under QEMU, tests/passes/test_int8_matmul.py). 2 x 255 x 64 = 32640 does
# not clip, so every CPU computes the exact int32 product: the same numbers everywhere.
WEIGHT_MAX = 64.0
# A row of zeros gets this as its max |a|, so its scale and reciprocal stay finite.
_TINY = 1e-30
# Codes are uint8 with zero point 128 for MLAS's U8S8 kernels (AVX2, AVX-512 VNNI, AMX): on x86
# MLAS has an S8S8 kernel for AVX-VNNI-INT8 CPUs only (platform.cpp) and runs int8 activations
# elsewhere through its portable C loop (measured on an AVX-512 VNNI Xeon: 8-100x slower).
_ZERO_POINT = 128
# ReduceMax takes its axes as an input from opset 18 on, as an attribute before.
_AXES_INPUT_OPSET = 18
_QUANTIZE_LINEAR_OPSET = 10


@dataclasses.dataclass(frozen=True)
class Int8Targets:
    """What the pass rewrites (rule 5): 4-bit nodes, and the DynamicQuantizeMatMul and
    MatMulIntegerToFloat nodes an earlier `--int8-matmul` wrote; how many 4-bit nodes it keeps
    (rule 2)."""

    int4: list[Int4MatMul]
    per_tensor: list[ir.Node]
    kept: int
    fused: list[ir.Node] = dataclasses.field(default_factory=list)


def int8_targets(model: ir.Model) -> Int8Targets:
    """The nodes the pass rewrites (rules 1-3, 5); ConfigError or ModelStructureError when the
    model cannot be rewritten."""
    graph = model.graph
    previous = metadata.read_int8_matmul(model)
    per_tensor = [] if previous is None else [node for node in graph if _ours(node)]
    fused = [] if previous is None else [node for node in graph if _fused(node)]
    matmuls, _ = find_int4_matmuls(graph, OPTION)
    if not matmuls and previous is None:
        raise ConfigError("--int8-matmul rewrites 4-bit com.microsoft::MatMulNBits, and the "
                          "model has none (its weights are not INT4); convert without it")
    head = _lm_head(graph) if matmuls else None
    targets = [matmul for matmul in matmuls
               if matmul.node is not head and _read_by_one(matmul)]
    nodes = [matmul.node for matmul in targets] + per_tensor
    if nodes or fused:
        check_row_int8_support(model)
    for node in nodes:
        activations = input_at(node, 0)
        if activations is None or activations.dtype != ir.DataType.FLOAT:
            raise ModelStructureError(
                f"{node.op_type} {node.name!r} computes in "
                f"{None if activations is None else activations.dtype}; the int8 matmul takes "
                "float32 activations only (a CPU export); convert without --int8-matmul")
    return Int8Targets(targets, per_tensor, len(matmuls) - len(targets), fused)


def default_refusal(model: ir.Model) -> str | None:
    """Why the default conversion keeps `model`'s weights as they are (None: it rewrites them).

    The rewrite is the default for an export not yet converted whose 4-bit layer MatMulNBits
    take float32 activations (a CPU export: the builder's GPU exports compute in float16), where
    the installed ONNX Runtime has the kernels it writes. A converted model keeps its matmuls,
    4-bit or int8 (its metadata says which). A model without 4-bit weights gets None from
    `has_int4_layers` first and is not asked."""
    if metadata.read_plan(model) is not None:
        return ("converted before: its matmuls stay as they are; --int8-matmul rewrites "
                "4-bit ones")
    try:
        targets = int8_targets(model)
    except (ConfigError, ModelStructureError) as error:
        return _without_remedy(str(error))
    if not targets.int4:
        return "its only 4-bit MatMulNBits is the lm_head, which reads the tied embedding"
    return None


def _without_remedy(message: str) -> str:
    """A refusal of `--int8-matmul` as a reason the default did not rewrite: its last clause,
    which tells a user who gave the option what to do instead, dropped."""
    reason, _, remedy = message.rpartition("; ")
    return reason if reason and OPTION in remedy else message


def has_int4_layers(model: ir.Model) -> bool:
    """Whether `model` has 4-bit MatMulNBits or matmuls an earlier `--int8-matmul` wrote."""
    return metadata.read_int8_matmul(model) is not None or any(
        is_int4_matmul(node) for node in model.graph)


def check_row_int8_support(model: ir.Model) -> None:
    """ModelStructureError when the installed ONNX Runtime or the model's opset lacks what rules
    4 and 5 write: MatMulInteger taking uint8 A and int8 B (read from the installed schema),
    QuantizeLinear and MatMulInteger (opset 10)."""
    from onnx_chunk.ort_schemas import input_types

    if ("tensor(uint8)" not in input_types("", MATMUL_INTEGER, "A")
            or "tensor(int8)" not in input_types("", MATMUL_INTEGER, "B")):
        import onnxruntime

        raise ModelStructureError(
            f"the installed ONNX Runtime ({onnxruntime.__version__}) has no "
            f"{MATMUL_INTEGER} of uint8 activations by int8 weights, which --int8-matmul "
            "writes; install one that has it, or convert without --int8-matmul")
    opset = model.opset_imports.get("", 0)
    if opset < _QUANTIZE_LINEAR_OPSET:
        raise ModelStructureError(
            f"the model imports ONNX opset {opset}, and --int8-matmul's per-row quantization "
            f"needs QuantizeLinear and MatMulInteger (opset {_QUANTIZE_LINEAR_OPSET} or later); "
            "export it at a newer opset or convert without --int8-matmul")


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


def _ours(node: ir.Node) -> bool:
    """Whether `node` is a DynamicQuantizeMatMul as the per-tensor `--int8-matmul` wrote it:
    int8 [K, N] weights, float32 scales per column, zero points absent or zero."""
    if node.op_type != DYNAMIC_QUANTIZE_MATMUL or node.domain != MICROSOFT_DOMAIN:
        return False
    weights, scales = input_at(node, _DQMM_B), input_at(node, _DQMM_SCALE)
    zero_points = input_at(node, _DQMM_ZERO_POINT)
    if weights is None or scales is None or weights.const_value is None or (
            scales.const_value is None):
        return False
    if weights.const_value.dtype != ir.DataType.INT8 or len(weights.const_value.shape) != 2:
        return False
    if scales.const_value.dtype != ir.DataType.FLOAT:
        return False
    return zero_points is None or (zero_points.const_value is not None
                                   and not np.any(zero_points.const_value.numpy()))


def _fused(node: ir.Node) -> bool:
    """Whether `node` is a MatMulIntegerToFloat as `--int8-matmul` wrote it: per-row codes of
    rule 4 (a QuantizeLinear node `int8_rows/...`), no bias."""
    if node.op_type != MATMUL_INTEGER_TO_FLOAT or node.domain != MICROSOFT_DOMAIN:
        return False
    codes = input_at(node, 0)
    producer = None if codes is None else codes.producer()
    return (producer is not None and producer.op_type == "QuantizeLinear"
            and (producer.name or "").startswith(f"{ROW_PREFIX}/")
            and all(input_at(node, index) is not None
                    for index in (_MITF_B, _MITF_ROW_SCALE, _MITF_B_SCALE))
            and input_at(node, _MITF_BIAS) is None)


def quantize_int8_columns(weights: np.ndarray, limit: float = WEIGHT_MAX
                          ) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float weights -> (B int8 [K, N], scale float32 [N]): symmetric, one scale per
    output column, max |w| / limit, codes within +-limit (a zero column gets scale 1 and
    zeros)."""
    peak = np.abs(weights).max(axis=1).astype(np.float32)
    scale = np.where(peak > 0, peak / np.float32(limit), 1.0).astype(np.float32)
    codes = np.clip(np.rint(weights / scale[:, None]), -limit, limit).astype(np.int8)
    return np.ascontiguousarray(codes.T), scale


class Int8MatMulPass(ir.passes.InPlacePass):
    """Rewrite the layers' 4-bit MatMulNBits as int8 matmuls with per-row activation scales
    (module docstring).

    Rules:
    1. A model without a 4-bit `com.microsoft::MatMulNBits`, and not converted by this pass
       before, is refused (ConfigError naming the option); a 4-bit node whose weights cannot
       be read exactly is refused as `--int4-block-size` refuses it (int4_blocks rule 2).
    2. Kept 4-bit: the lm_head (logits_rows' `find_lm_head`: with last-row logits it computes
       one row per forward, and it is the largest matrix) and a node whose weights another node
       also reads (an lm_head tied to a GatherBlockQuantized embedding).
    3. A node to rewrite must take float32 activations (ModelStructureError naming it), the
       installed ONNX Runtime's schema must have MatMulInteger taking uint8 A and int8 B, and
       the model must import ONNX opset 10 or later (QuantizeLinear, MatMulInteger); otherwise
       ModelStructureError naming the option.
    4. Each activation tensor the rewritten nodes read is quantized once, per row, by nodes
       named `int8_rows/...`: m = max(ReduceMax(|a|, last axis, keepdims), 1e-30), row scale
       s = m * (1/127), codes = QuantizeLinear(a * (127 / m), 1, uint8 128). The row scale
       keeps the activations' rank (its last axis is 1): one scale per row.
    5. Each rewritten node becomes `MatMulInteger(codes, B, 128)` under its name, then
       `Cast` to float32, `Mul` by b_scale, `Mul` by s, the last taking its output: B int8
       [K, N] and b_scale float32 [N] from `quantize_int8_columns` of the exact dequantized
       weights (`dequantize_int4`), new initializers written to the data file at save
       (`model_io.write_to_data_file`); its 4-bit initializers are removed. A bias
       (MatMulNBits input 5) is added by an `Add` after it. A `DynamicQuantizeMatMul` this
       pass wrote before (the metadata says so; int8 B, per-column scales, zero points zero)
       becomes the same, with its own B and scales; so does a `MatMulIntegerToFloat(codes, B,
       s, b_scale, 128)` it wrote before (same numbers).
    6. The metadata (`onnx_chunk.int8_matmul`) records the nodes rewritten from 4-bit, the
       4-bit nodes kept and the weights' bound (64); a folder converted before the bound keeps
       its weights and its missing bound (`load` warns about it). Running the pass again
       reports `modified=False`.
    """

    def requires(self, model: ir.Model) -> None:
        """Rules 1-3, on a model the pass has not rewritten yet."""
        if metadata.read_int8_matmul(model) is None:
            with precondition():
                int8_targets(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        previous = metadata.read_int8_matmul(model)
        targets = int8_targets(model)
        if not targets.int4 and not targets.per_tensor and not targets.fused:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        rows = _RowQuantizer(graph, model.opset_imports.get("", 0))
        rewritten = {id(matmul.node) for matmul in targets.int4}
        per_tensor = {id(node) for node in targets.per_tensor}
        fused = {id(node) for node in targets.fused}
        int4 = {id(matmul.node): matmul for matmul in targets.int4}
        for node in list(graph):  # graph order: a shared activation is quantized before its uses
            if id(node) in rewritten:
                self._rewrite_int4(graph, int4[id(node)], rows)
            elif id(node) in per_tensor:
                self._rewrite_per_tensor(graph, node, rows)
            elif id(node) in fused:
                _unfuse(graph, node, rows)
        done = len(targets.int4) + (0 if previous is None else previous.rewritten_nodes)
        # A folder written before the bound keeps its +-127 codes (the 4-bit weights are gone).
        bound = int(WEIGHT_MAX) if previous is None else previous.weight_max
        metadata.write_int8_matmul(model, metadata.Int8MatMulDeclaration(
            rewritten_nodes=done, kept_int4_nodes=targets.kept, weight_max=bound))
        logger.info("int8 matmul: %d 4-bit MatMulNBits, %d per-tensor DynamicQuantizeMatMul and "
                    "%d MatMulIntegerToFloat nodes rewritten with per-row activation scales, "
                    "%d 4-bit kept", len(targets.int4), len(targets.per_tensor),
                    len(targets.fused), targets.kept)
        return ir.passes.PassResult(model, modified=True)

    def _rewrite_int4(self, graph: ir.Graph, matmul: Int4MatMul, rows: _RowQuantizer) -> None:
        """Rule 5 for a 4-bit node."""
        node = matmul.node
        assert matmul.packed.const_value is not None and matmul.scales.const_value is not None
        zero_points = (None if matmul.zero_points is None or matmul.zero_points.const_value is None
                       else matmul.zero_points.const_value.numpy())
        weights = dequantize_int4(matmul.packed.const_value.numpy(),
                                  matmul.scales.const_value.numpy(), zero_points, matmul.k,
                                  matmul.block_size).astype(np.float32)
        codes, scale = quantize_int8_columns(weights)
        name = node.name or (matmul.packed.name or "matmul")
        b, b_scale = (write_to_data_file(_initializer(graph, f"{name}.int8.{suffix}", array))
                      for suffix, array in (("B", codes), ("scale", scale)))
        _replace(graph, node, rows, b, b_scale, input_at(node, _NBITS_BIAS_INPUT))
        _drop_unused(graph, (matmul.packed, matmul.scales, matmul.zero_points))

    def _rewrite_per_tensor(self, graph: ir.Graph, node: ir.Node, rows: _RowQuantizer) -> None:
        """Rule 5 for a DynamicQuantizeMatMul an earlier `--int8-matmul` wrote."""
        b, b_scale = input_at(node, _DQMM_B), input_at(node, _DQMM_SCALE)
        zero_point = input_at(node, _DQMM_ZERO_POINT)
        assert b is not None and b_scale is not None
        _replace(graph, node, rows, b, b_scale, input_at(node, _DQMM_BIAS))
        _drop_unused(graph, (zero_point,))


def _replace(graph: ir.Graph, node: ir.Node, rows: _RowQuantizer, b: ir.Value,
             b_scale: ir.Value, bias: ir.Value | None) -> None:
    """`node` becomes the int8 matmul of rule 5 over its activations' per-row codes (+ bias)."""
    activations = input_at(node, 0)
    assert activations is not None
    codes, row_scale = rows.quantized(activations, before=node)
    _write_int8(graph, node, rows, codes, b, row_scale, b_scale, bias)


def _unfuse(graph: ir.Graph, node: ir.Node, rows: _RowQuantizer) -> None:
    """Rule 5 for a MatMulIntegerToFloat an earlier `--int8-matmul` wrote: the same inputs."""
    codes, b, row_scale, b_scale = (input_at(node, index) for index in (
        0, _MITF_B, _MITF_ROW_SCALE, _MITF_B_SCALE))
    assert codes is not None and b is not None and row_scale is not None and b_scale is not None
    _write_int8(graph, node, rows, codes, b, row_scale, b_scale, None)


def _write_int8(graph: ir.Graph, node: ir.Node, rows: _RowQuantizer, codes: ir.Value,
                b: ir.Value, row_scale: ir.Value, b_scale: ir.Value,
                bias: ir.Value | None) -> None:
    """MatMulInteger -> Cast -> Mul(b_scale) -> Mul(row scale) (-> Add(bias)) in `node`'s
    place: MatMulIntegerToFloat's arithmetic, in its order, from standard nodes."""
    output = node.outputs[0]
    base = name_of(output)
    zero_point = rows.constant("zero_point", np.uint8(_ZERO_POINT))
    added: list[ir.Node] = []

    def add(op_type: str, inputs: list[ir.Value], suffix: str, **attributes: int) -> ir.Value:
        made = ir.node(op_type, inputs, attributes or None,
                       name=node.name if op_type == MATMUL_INTEGER else f"{node.name}/{suffix}")
        added.append(made)
        made.outputs[0].name = f"{base}/{suffix}"
        return made.outputs[0]

    product = add(MATMUL_INTEGER, [codes, b, zero_point], "int32")
    floats = add("Cast", [product], "float", to=ir.DataType.FLOAT.value)
    columns = add("Mul", [floats, b_scale], "columns")
    result = add("Mul", [columns, row_scale], "int8")
    if bias is not None:
        result = add("Add", [result, bias], "bias")
    replace_node(graph, node, added, result)


def replace_node(graph: ir.Graph, node: ir.Node, added: list[ir.Node], result: ir.Value) -> None:
    """`added` (ending in `result`) takes `node`'s place: inserted before it, `result` takes its
    one output's name, shape, type, uses and graph-output slot, and `node` is removed."""
    output = node.outputs[0]
    name = output.name
    output.name = f"{name}/replaced"  # the name passes to the new value
    result.name, result.shape, result.type = name, output.shape, output.type
    graph.insert_before(node, added)
    if output in graph.outputs:
        graph.outputs[graph.outputs.index(output)] = result
    ir.convenience.replace_all_uses_with(output, result)
    graph.remove(node, safe=True)


def _drop_unused(graph: ir.Graph, values: tuple[ir.Value | None, ...]) -> None:
    for old in values:
        if (old is not None and old.name is not None and old.name in graph.initializers
                and not old.uses()):
            graph.initializers.pop(old.name)


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    if name in graph.initializers:
        raise ModelStructureError(f"the model already has an initializer {name!r}, the "
                                  "name --int8-matmul gives a rewritten weight; rename it")
    value = ir.Value(name=name, shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


class _RowQuantizer:
    """Rule 4: the per-row codes and scales of each activation tensor, made once."""

    def __init__(self, graph: ir.Graph, opset: int) -> None:
        self._graph = graph
        self._opset = opset
        self._done: dict[int, tuple[ir.Value, ir.Value]] = {}

    def constant(self, name: str, value: np.generic | np.ndarray) -> ir.Value:
        """A small initializer `int8_rows/<name>` kept inside the .onnx, registered once."""
        array = np.asarray(value)
        full = f"{ROW_PREFIX}/{name}"
        existing = self._graph.initializers.get(full)
        if existing is not None:
            known = existing.const_value
            if (known is None or known.dtype != ir.DataType.from_numpy(array.dtype)
                    or not np.array_equal(known.numpy(), array)):
                raise ModelStructureError(f"the model already has an initializer {full!r}, "
                                          "a name --int8-matmul gives a constant; rename it")
            return existing
        return _initializer(self._graph, full, array)

    def quantized(self, activations: ir.Value, before: ir.Node) -> tuple[ir.Value, ir.Value]:
        """(uint8 codes, float32 row scales) of `activations`; nodes go before `before` the
        first time."""
        if id(activations) in self._done:
            return self._done[id(activations)]
        prefix = f"{ROW_PREFIX}/{name_of(activations)}"
        nodes: list[ir.Node] = []

        def add(suffix: str, op_type: str, inputs: list[ir.Value],
                **attributes: int | list[int]) -> ir.Value:
            node = ir.node(op_type, inputs, attributes or None, name=f"{prefix}/{suffix}")
            nodes.append(node)
            value = node.outputs[0]
            value.name = f"{prefix}/{suffix}"
            return value

        magnitude = add("abs", "Abs", [activations])
        if self._opset >= _AXES_INPUT_OPSET:
            peak = add("max", "ReduceMax", [magnitude, self.constant(
                "last_axis", np.array([-1], np.int64))], keepdims=1)
        else:
            peak = add("max", "ReduceMax", [magnitude], axes=[-1], keepdims=1)
        peak = add("nonzero", "Max", [peak, self.constant("tiny", np.float32(_TINY))])
        scale = add("scale", "Mul", [peak, self.constant(
            "inverse_int8_max", np.float32(1 / _INT8_MAX))])
        reciprocal = add("reciprocal", "Div", [self.constant(
            "int8_max", np.float32(_INT8_MAX)), peak])
        scaled = add("scaled", "Mul", [activations, reciprocal])
        codes = add("codes", "QuantizeLinear", [scaled, self.constant("one", np.float32(1.0)),
                                                self.constant("zero_point",
                                                              np.uint8(_ZERO_POINT))])
        shape = activations.shape
        codes.type = ir.TensorType(ir.DataType.UINT8)
        scale.type = ir.TensorType(ir.DataType.FLOAT)
        if shape is not None and len(shape) >= 1:
            codes.shape = ir.Shape(list(shape))
            scale.shape = ir.Shape([*list(shape)[:-1], 1])
        self._graph.insert_before(before, nodes)
        self._done[id(activations)] = (codes, scale)
        return codes, scale
