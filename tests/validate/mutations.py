"""Broken decoders made from the reference decoder: each mutation breaks one property."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def copy_model(model_path: Path, target_dir: Path) -> Path:
    """Copy a model's folder (graph, external data, companions); return the new model path."""
    shutil.copytree(model_path.parent, target_dir)
    return target_dir / model_path.name


def edit_graph(model_path: Path, change: Callable[[onnx.ModelProto], None]) -> None:
    """Apply `change` to the protobuf (weights stay external and untouched) and save it."""
    proto = onnx.load(str(model_path), load_external_data=False)
    change(proto)
    model_path.write_bytes(proto.SerializeToString())


def _gqa(proto: onnx.ModelProto, layer: int) -> onnx.NodeProto:
    return next(node for node in proto.graph.node if node.op_type == "GroupQueryAttention"
                and f"layers.{layer}/" in node.name)


def past_from_zero_constant(layer: int, capacity: int) -> Callable[[onnx.ModelProto], None]:
    """GQA `layer` reads its past key/value from a zero constant of capacity shape instead of
    the graph inputs (which are removed): the layer never sees earlier chunks."""

    def change(proto: onnx.ModelProto) -> None:
        node = _gqa(proto, layer)
        inputs = {value.name: value for value in proto.graph.input}
        past = inputs[node.input[3]]
        dims = [dim.dim_value or 1 for dim in past.type.tensor_type.shape.dim]
        dims[2] = capacity
        zeros = numpy_helper.from_array(np.zeros(dims, np.float32), f"zero_past_{layer}")
        proto.graph.initializer.append(zeros)
        for index in (3, 4):
            proto.graph.input.remove(inputs[node.input[index]])
            node.input[index] = zeros.name

    return change


def _rows_and_one(prefix: str) -> list[onnx.NodeProto]:
    """Nodes making `{prefix}/rows` (the chunk's rows, int32 [1]) and `{prefix}/one`."""
    return [
        helper.make_node("Shape", ["input_ids"], [f"{prefix}/shape"], start=1, end=2),
        helper.make_node("Cast", [f"{prefix}/shape"], [f"{prefix}/rows"], to=TensorProto.INT32),
        helper.make_node("Constant", [], [f"{prefix}/one"],
                         value=helper.make_tensor("one", TensorProto.INT32, [1], [1])),
    ]


def seqlens_without_past(layer: int) -> Callable[[onnx.ModelProto], None]:
    """GQA `layer` gets seqlens_k = rows - 1 and total_sequence_length = rows, as if its past
    were empty: structurally sound, but chunks after the first ignore the earlier ones."""

    def change(proto: onnx.ModelProto) -> None:
        node = _gqa(proto, layer)
        prefix = f"/blind{layer}"
        proto.graph.node.extend([
            *_rows_and_one(prefix),
            helper.make_node("Sub", [f"{prefix}/rows", f"{prefix}/one"], [f"{prefix}/seqlens"]),
            helper.make_node("ReduceMax", [f"{prefix}/rows"], [f"{prefix}/total"],
                             keepdims=0),
        ])
        node.input[5] = f"{prefix}/seqlens"
        node.input[6] = f"{prefix}/total"
        _topological_sort(proto)

    return change


def past_one_short(layer: int) -> Callable[[onnx.ModelProto], None]:
    """GQA `layer` is told its past is one position shorter whenever it has one (seqlens_k - 1
    when seqlens_k + 1 exceeds the chunk's rows): a chunk after the first writes its KV one
    position early, over the last row of the previous chunk, and its rotary positions are off
    by one. A prompt in one chunk is unaffected."""

    def change(proto: onnx.ModelProto) -> None:
        node = _gqa(proto, layer)
        prefix = f"/short{layer}"
        seqlens = node.input[5]
        proto.graph.node.extend([
            *_rows_and_one(prefix),
            helper.make_node("Add", [seqlens, f"{prefix}/one"], [f"{prefix}/total"]),
            helper.make_node("Greater", [f"{prefix}/total", f"{prefix}/rows"],
                             [f"{prefix}/has_past"]),
            helper.make_node("Cast", [f"{prefix}/has_past"], [f"{prefix}/shift"],
                             to=TensorProto.INT32),
            helper.make_node("Sub", [seqlens, f"{prefix}/shift"], [f"{prefix}/seqlens"]),
        ])
        node.input[5] = f"{prefix}/seqlens"
        _topological_sort(proto)

    return change


# How much a fake kernel moves the rows it rounds differently: far more than a real kernel
# does (a few ulps), so that the difference it makes exceeds the base tolerance 1e-5.
FAKE_ROUNDING = 2.0 ** -12


def rounds_by_row_count(layer: int, kind: str, block: int = 8) -> Callable[[onnx.ModelProto],
                                                                           None]:
    """A fake kernel after GQA `layer`'s output: it moves some rows by FAKE_ROUNDING of their
    value, chosen by the forward's row count S alone, as kernels that tile or split rows do.

    `kind` "lone block": the last row of a forward of S = k * block + 1 rows (S > 1), alone in
    its block (ONNX Runtime's CPU GroupQueryAttention with block = 2 x head size); "threads":
    the rows of the second half, [ceil(S / 2), S), as a second thread's share of the rows;
    "one row": the row of a forward of one row (a decode step), as MLAS's one-row GEMM.
    Mathematically nothing changes, so validate must pass such a decoder."""

    def change(proto: onnx.ModelProto) -> None:
        node = _gqa(proto, layer)
        prefix = f"/fake{layer}"
        attention = node.output[0]
        moved = f"{prefix}/moved"
        for other in proto.graph.node:
            for index, name in enumerate(other.input):
                if name == attention:
                    other.input[index] = moved

        def const(name: str, value: float | int, dtype: int = TensorProto.INT64) -> onnx.NodeProto:
            return helper.make_node("Constant", [], [f"{prefix}/{name}"],
                                    value=helper.make_tensor(name, dtype, [], [value]))

        nodes = [
            helper.make_node("Shape", [attention], [f"{prefix}/shape"], start=1, end=2),
            helper.make_node("Squeeze", [f"{prefix}/shape"], [f"{prefix}/rows"]),
            const("zero", 0), const("one", 1), const("two", 2), const("block", block),
            const("eps", FAKE_ROUNDING, TensorProto.FLOAT),
            helper.make_node("Range", [f"{prefix}/zero", f"{prefix}/rows", f"{prefix}/one"],
                             [f"{prefix}/index"]),
        ]
        if kind == "lone block":
            nodes += [
                helper.make_node("Sub", [f"{prefix}/rows", f"{prefix}/one"], [f"{prefix}/last"]),
                helper.make_node("Equal", [f"{prefix}/index", f"{prefix}/last"],
                                 [f"{prefix}/is_last"]),
                helper.make_node("Mod", [f"{prefix}/rows", f"{prefix}/block"],
                                 [f"{prefix}/left"]),
                helper.make_node("Equal", [f"{prefix}/left", f"{prefix}/one"],
                                 [f"{prefix}/lone"]),
                helper.make_node("Greater", [f"{prefix}/rows", f"{prefix}/one"],
                                 [f"{prefix}/several"]),
                helper.make_node("And", [f"{prefix}/lone", f"{prefix}/several"],
                                 [f"{prefix}/alone"]),
                helper.make_node("And", [f"{prefix}/is_last", f"{prefix}/alone"],
                                 [f"{prefix}/chosen"]),
            ]
        elif kind == "threads":
            nodes += [
                helper.make_node("Add", [f"{prefix}/rows", f"{prefix}/one"], [f"{prefix}/up"]),
                helper.make_node("Div", [f"{prefix}/up", f"{prefix}/two"], [f"{prefix}/half"]),
                helper.make_node("GreaterOrEqual", [f"{prefix}/index", f"{prefix}/half"],
                                 [f"{prefix}/chosen"]),
            ]
        elif kind == "one row":
            nodes += [
                helper.make_node("Equal", [f"{prefix}/rows", f"{prefix}/one"],
                                 [f"{prefix}/single"]),
                helper.make_node("Expand", [f"{prefix}/single", f"{prefix}/shape"],
                                 [f"{prefix}/chosen"]),
            ]
        else:
            raise ValueError(f"unknown fake kernel {kind!r}")
        nodes += [
            helper.make_node("Cast", [f"{prefix}/chosen"], [f"{prefix}/flag"],
                             to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{prefix}/flag", f"{prefix}/eps"], [f"{prefix}/scale"]),
            helper.make_node("Unsqueeze", [f"{prefix}/scale", f"{prefix}/axes"],
                             [f"{prefix}/column"]),
            helper.make_node("Mul", [attention, f"{prefix}/column"], [f"{prefix}/delta"]),
            helper.make_node("Add", [attention, f"{prefix}/delta"], [moved]),
        ]
        proto.graph.initializer.append(
            numpy_helper.from_array(np.array([0, 2], np.int64), f"{prefix}/axes"))
        proto.graph.node.extend(nodes)
        _topological_sort(proto)

    return change


def set_metadata(key: str, value: str) -> Callable[[onnx.ModelProto], None]:
    def change(proto: onnx.ModelProto) -> None:
        entry = next(entry for entry in proto.metadata_props if entry.key == key)
        entry.value = value

    return change


def _topological_sort(proto: onnx.ModelProto) -> None:
    produced = {value.name for value in proto.graph.input}
    produced |= {tensor.name for tensor in proto.graph.initializer}
    pending = list(proto.graph.node)
    ordered = []
    while pending:
        ready = [node for node in pending
                 if all(not name or name in produced for name in node.input)]
        assert ready, "the mutation left a cycle or a dangling input"
        for node in ready:
            ordered.append(node)
            produced.update(node.output)
            pending.remove(node)
    del proto.graph.node[:]
    proto.graph.node.extend(ordered)
