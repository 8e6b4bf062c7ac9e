"""Re-block the 4-bit weights of MatMulNBits to another block size (`convert --int4-block-size`).

ONNX Runtime's int8-compute MatMulNBits kernel (accuracy_level 4) does per-block work that
shrinks with the block: at 512 rows on AVX-512 VNNI the kernel runs 1.3-1.5x faster at block
128 than at the builder's default 32 (issue #34). A builder export comes without its float weights,
so this pass dequantizes each node's weights exactly and quantizes them again, with ONNX
Runtime's own quantizer, at the block asked for: a second quantization, so the logits (and
possibly the tokens) move a little from the source export's.

The layouts are the MatMulNBits schema's (ONNX Runtime 1.32's `get_all_operator_schema()`;
docs/ContribOperators.md in its repository): B is uint8 [N, k_blocks, block_size / 2] with the
weights of one output column along K, two a byte, the first in the low nibble; scales are
[N, k_blocks] (the builder writes them 2-D, ORT's quantizer flat); zero_points are uint8
[N, ceil(k_blocks / 2)] packed the same way, and 8 when absent (symmetric).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import write_to_data_file
from onnx_chunk.passes.preconditions import precondition
from onnx_chunk.passes.value_tracing import MICROSOFT_DOMAIN, input_at

logger = logging.getLogger(__name__)

INT4_BLOCK_SIZES = (32, 64, 128, 256)
MATMUL_NBITS = "MatMulNBits"
_B_INPUT, _SCALES_INPUT, _ZERO_POINTS_INPUT, _G_IDX_INPUT = 1, 2, 3, 4
_DEFAULT_ZERO_POINT = 8
# ONNX Runtime's quantize_matmul_4bits has a float32 and a float16 overload
# (onnxruntime/python/onnxruntime_pybind_quant.cc).
_SCALE_TYPES = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


@dataclasses.dataclass(frozen=True)
class Int4MatMul:
    """One 4-bit MatMulNBits node and its weight initializers."""

    node: ir.Node
    packed: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    k: int
    n: int
    block_size: int


def _attribute(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attribute = node.attributes.get(name)
    return default if attribute is None else int(attribute.as_int())


def _is_matmul_nbits(node: ir.Node) -> bool:
    return node.op_type == MATMUL_NBITS and node.domain == MICROSOFT_DOMAIN


def is_int4_matmul(node: ir.Node) -> bool:
    """Whether `node` is a com.microsoft MatMulNBits of 4 bits."""
    return _is_matmul_nbits(node) and _attribute(node, "bits", 4) == 4


def find_int4_matmuls(graph: ir.Graph, option: str = "--int4-block-size"
                      ) -> tuple[list[Int4MatMul], int]:
    """The 4-bit MatMulNBits nodes of `graph` and how many MatMulNBits nodes of other bit
    widths it has; ModelStructureError naming the first 4-bit node whose weights cannot be
    read exactly (rule 2), and `option`, the conversion that needed them."""
    found, others = [], 0
    for node in graph:
        if is_int4_matmul(node):
            found.append(_checked(node, option))
        elif _is_matmul_nbits(node):
            others += 1
    return found, others


def check_int4_blocks(model: ir.Model, block_size: int) -> tuple[list[Int4MatMul], int]:
    """Before any work: `find_int4_matmuls`, and ConfigError for a block size not in
    INT4_BLOCK_SIZES or a model without 4-bit MatMulNBits (Int4BlocksPass rules 1 and 2)."""
    _check_block_size(block_size)
    matmuls, others = find_int4_matmuls(model.graph)
    if not matmuls:
        raise ConfigError("--int4-block-size applies to 4-bit com.microsoft::MatMulNBits "
                          "weights, and the model has none; convert it without the option")
    return matmuls, others


def _check_block_size(block_size: int) -> None:
    if block_size not in INT4_BLOCK_SIZES:
        raise ConfigError(f"int4 block size must be one of "
                          f"{', '.join(map(str, INT4_BLOCK_SIZES))}, got {block_size!r}")


def _checked(node: ir.Node, option: str) -> Int4MatMul:
    label = f"MatMulNBits {node.name!r}"
    k, n, block = (_attribute(node, "K"), _attribute(node, "N"), _attribute(node, "block_size"))
    if k is None or n is None or block is None:
        raise ModelStructureError(f"{label} lacks its K, N or block_size attribute, so its "
                                  "weights cannot be read; export the model again")
    if input_at(node, _G_IDX_INPUT) is not None:
        raise ModelStructureError(f"{label} reads a g_idx (act-order) input, which "
                                  f"{option} cannot read; convert without it")
    if _attribute(node, "weight_prepacked", 0):
        raise ModelStructureError(f"{label} holds weights prepacked for one execution provider, "
                                  f"which {option} cannot read; convert without it")
    values = [input_at(node, index) for index in (_B_INPUT, _SCALES_INPUT, _ZERO_POINTS_INPUT)]
    packed, scales, zero_points = values
    if packed is None or scales is None or any(
            value is not None and value.const_value is None for value in values):
        raise ModelStructureError(f"{label}: its weights, scales or zero points are not "
                                  f"initializers, so {option} cannot read them")
    blocks = -(-k // block)
    expected = {"B": (packed, ir.DataType.UINT8, n * blocks * (block // 2)),
                "scales": (scales, None, n * blocks),
                "zero_points": (zero_points, ir.DataType.UINT8, n * (-(-blocks // 2)))}
    for what, (value, dtype, size) in expected.items():
        if value is None:
            continue
        tensor = value.const_value
        assert tensor is not None
        if dtype is not None and tensor.dtype != dtype:
            raise ModelStructureError(f"{label}: its {what} are {tensor.dtype}, not packed "
                                      f"{dtype}, which {option} cannot read")
        if tensor.size != size:
            raise ModelStructureError(f"{label}: its {what} hold {tensor.size} values, the "
                                      f"schema's layout for K={k}, N={n}, block_size={block} "
                                      f"{size}; export the model again")
    assert scales.const_value is not None
    if scales.const_value.dtype not in _SCALE_TYPES:
        raise ModelStructureError(f"{label}: its scales are {scales.const_value.dtype}; "
                                  f"{option} reads float32 and float16 only")
    return Int4MatMul(node, packed, scales, zero_points, k, n, block)


def _unpack_nibbles(packed: np.ndarray, rows: int, count: int) -> np.ndarray:
    """The first `count` 4-bit values (low nibble first) of each of `rows` rows of `packed`, flat
    or not."""
    bytes_ = packed.reshape(rows, -1)
    values = np.stack([bytes_ & 0x0F, bytes_ >> 4], axis=-1).reshape(rows, -1)
    return values[:, :count]


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                    k: int, block_size: int) -> np.ndarray:
    """The [N, K] weights MatMulNBits computes with, in the scales' dtype (module layouts)."""
    n = packed.shape[0]
    blocks = -(-k // block_size)
    codes = _unpack_nibbles(packed, n, blocks * block_size).astype(np.float32)
    zeros = (np.full((n, blocks), _DEFAULT_ZERO_POINT, np.float32) if zero_points is None
             else _unpack_nibbles(zero_points, n, blocks).astype(np.float32))
    per_block = scales.reshape(n, blocks).astype(np.float32)
    weights = (codes.reshape(n, blocks, block_size) - zeros[..., None]) * per_block[..., None]
    return weights.reshape(n, blocks * block_size)[:, :k].astype(scales.dtype)


def quantize_int4(weights: np.ndarray, block_size: int, symmetric: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[N, K] weights quantized by ONNX Runtime's `quantize_matmul_4bits`, as its
    matmul_nbits_quantizer.py calls it (weights [K, N] padded to whole blocks; N, then K):
    B [N, k_blocks, block_size / 2], scales [N, k_blocks], zero points [N, ceil(k_blocks / 2)]
    (None when symmetric)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    n, k = weights.shape
    blocks = -(-k // block_size)
    source = np.zeros((blocks * block_size, n), dtype=weights.dtype)
    source[:k] = weights.T
    packed = np.zeros((n, blocks, block_size // 2), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=weights.dtype)
    zero_points = np.zeros((n, -(-blocks // 2)), dtype=np.uint8)
    quantize_matmul_4bits(packed, source, scales, zero_points, block_size, n, k, symmetric)
    return packed, scales, None if symmetric else zero_points


class Int4BlocksPass(ir.passes.InPlacePass):
    """Give every 4-bit MatMulNBits the block size `block_size` (module docstring).

    Rules:
    1. `block_size` is one of INT4_BLOCK_SIZES (ConfigError otherwise). A model without a
       4-bit `com.microsoft::MatMulNBits` is refused (ConfigError naming the option); nodes of
       other bit widths are left as they are and counted.
    2. A 4-bit node whose weights cannot be read exactly is refused (ModelStructureError,
       one line naming it): a g_idx input, prepacked weights, weights that are no
       initializers, zero points that are not packed uint8, scales that are not float32 or
       float16, tensors whose sizes are not the schema's for its K, N and block size.
    3. A node at another block size gets its weights dequantized exactly (`dequantize_int4`)
       and quantized again at `block_size` by ONNX Runtime's quantizer (`quantize_int4`),
       symmetric when the node had no zero points, asymmetric otherwise; its `block_size`
       attribute changes, every other attribute (K, N, bits, accuracy_level) stays.
       K below the block size, or not a multiple of it, is one partial block
       (ORT pads it).
    4. The new B, scales and zero points keep the rank of the old ones. An old initializer
       only re-blocked nodes read is replaced under its name; one another node reads too
       (lm_head weights tied to a GatherBlockQuantized embedding) stays for that node, and the
       re-blocked copy is named `<name>.block<block_size>`.
    5. Nodes already at `block_size` are untouched. The metadata (`onnx_chunk.int4_blocks`)
       records the block size, the 4-bit node count, the nodes re-blocked and the block sizes
       they had; running the pass again reports `modified=False`.
    """

    def __init__(self, block_size: int) -> None:
        super().__init__()
        _check_block_size(block_size)
        self.block_size = block_size

    def requires(self, model: ir.Model) -> None:
        """Rules 1 and 2: 4-bit nodes, each of whose weights can be read exactly."""
        with precondition():
            check_int4_blocks(model, self.block_size)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        matmuls, others = find_int4_matmuls(graph)
        targets = [matmul for matmul in matmuls if matmul.block_size != self.block_size]
        replaced: dict[int, ir.Value] = {}
        reblocked_nodes = {id(matmul.node) for matmul in targets}
        for matmul in targets:
            self._reblock(graph, matmul, replaced, reblocked_nodes)
        if others:
            logger.info("int4 blocks: %d MatMulNBits nodes of other bit widths left as they are",
                        others)
        previous = metadata.read_int4_blocks(model)
        if not targets and previous is not None and previous.block_size == self.block_size:
            return ir.passes.PassResult(model, modified=False)
        declaration = metadata.Int4BlocksDeclaration(
            block_size=self.block_size, nodes=len(matmuls), reblocked_nodes=len(targets),
            source_block_sizes=sorted({matmul.block_size for matmul in targets}),
            other_bits_nodes=others)
        metadata.write_int4_blocks(model, declaration)
        logger.info("int4 blocks: %d of %d 4-bit MatMulNBits nodes re-blocked to %d",
                    len(targets), len(matmuls), self.block_size)
        return ir.passes.PassResult(model, modified=True)

    def _reblock(self, graph: ir.Graph, matmul: Int4MatMul, replaced: dict[int, ir.Value],
                 reblocked_nodes: set[int]) -> None:
        """Rules 3 and 4 for one node; `replaced` maps an old value to its re-blocked one, so
        a tensor two re-blocked nodes share is re-blocked once."""
        olds = (matmul.packed, matmul.scales, matmul.zero_points)
        if all(old is None or id(old) in replaced for old in olds):
            news = [None if old is None else replaced[id(old)] for old in olds]
        else:
            packed, scales = _array(matmul.packed), _array(matmul.scales)
            zero_points = None if matmul.zero_points is None else _array(matmul.zero_points)
            weights = dequantize_int4(packed, scales, zero_points, matmul.k, matmul.block_size)
            arrays = quantize_int4(weights, self.block_size, symmetric=zero_points is None)
            news = [None if old is None else self._register(graph, old, array, reblocked_nodes)
                    for old, array in zip(olds, arrays)]
            for old, new in zip(olds, news):
                if old is not None and new is not None:
                    replaced[id(old)] = new
        for index, new in zip((_B_INPUT, _SCALES_INPUT, _ZERO_POINTS_INPUT), news):
            if new is not None:
                matmul.node.replace_input_with(index, new)
        matmul.node.attributes["block_size"] = ir.AttrInt64("block_size", self.block_size)

    def _register(self, graph: ir.Graph, old: ir.Value, array: np.ndarray | None,
                  reblocked_nodes: set[int]) -> ir.Value:
        assert array is not None and old.const_value is not None and old.name is not None
        if len(old.const_value.shape) != array.ndim:
            array = array.reshape(-1)
        name = old.name
        if all(id(user) in reblocked_nodes for user, _ in old.uses()) and (
                old not in graph.inputs and old not in graph.outputs):
            graph.initializers.pop(name)
        else:
            name = f"{old.name}.block{self.block_size}"
            if name in graph.initializers:
                raise ModelStructureError(f"the model already has an initializer {name!r}, the "
                                          f"name of {old.name!r} re-blocked; rename it first")
        value = ir.Value(name=name, shape=ir.Shape(array.shape),
                         type=ir.TensorType(old.const_value.dtype),
                         const_value=ir.tensor(array, name=name))
        graph.register_initializer(value)
        return write_to_data_file(value)


def _array(value: ir.Value) -> np.ndarray:
    assert value.const_value is not None, "find_int4_matmuls checked the initializers"
    return value.const_value.numpy()


