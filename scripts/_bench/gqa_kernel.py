"""One GroupQueryAttention node at a model's shape, timed per KV cache type (bench_kv_cache.py
kernel): where ONNX Runtime's attention kernels stand, apart from the rest of a forward.

Each system is a one-node graph (packed QKV with rotary, as the builder exports it; past and
present bound to one buffer at capacity past + rows, as the runtime binds them): `float32`,
`int8` and `int4` (per-channel scales, ONNX Runtime's quantized kernel), `int8t` (per-tensor:
the one ORT_MLAS_QKGEMM_S8_APPROX_VNNI=1 changes), `int8-noflash` (the quantized kernel with
ORT_GQA_DISABLE_FLASH_ATTENTION=1, read when the session is made), `int8d` and `int4d` (the
node after passes.kv_prefill: float attention over the dequantized cache).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.passes.kv_prefill import KVPrefillPass

SYSTEMS = ("float32", "int8", "int4", "int8t", "int8-noflash", "int8d", "int4d")
_NOFLASH = "ORT_GQA_DISABLE_FLASH_ATTENTION"


def _graph(heads: int, kv_heads: int, size: int, bits: int, scales: str,
           positions: int) -> onnx.ModelProto:
    cache = {32: TensorProto.FLOAT, 8: TensorProto.INT8, 4: TensorProto.UINT8}[bits]
    width = size // 2 if bits == 4 else size
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT,
                                            [1, "rows", (heads + 2 * kv_heads) * size]),
              helper.make_tensor_value_info("past_key", cache, [1, kv_heads, "cap", width]),
              helper.make_tensor_value_info("past_value", cache, [1, kv_heads, "cap", width]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "rows", heads * size]),
               helper.make_tensor_value_info("present_key", cache, [1, kv_heads, "cap", width]),
               helper.make_tensor_value_info("present_value", cache, [1, kv_heads, "cap", width])]
    angles = np.outer(np.arange(positions), 1.0 / 10000 ** (np.arange(0, size, 2) / size))
    initializers = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                    numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    names = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"]
    attributes: dict[str, Any] = {"num_heads": heads, "kv_num_heads": kv_heads,
                                     "do_rotary": 1, "scale": size ** -0.5}
    if bits != 32:
        shape = [1, kv_heads, 1, size] if scales == "PER_CHANNEL" else [1]
        scale = np.full(shape, 0.02 if bits == 8 else 0.4, np.float32)
        initializers += [numpy_helper.from_array(scale, "k_scale"),
                         numpy_helper.from_array(scale, "v_scale")]
        names += ["", "", "", "k_scale", "v_scale"]
        attributes.update(k_quant_type=scales, v_quant_type=scales, kv_cache_bit_width=bits)
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"],
                            domain="com.microsoft", name="attention", **attributes)
    return helper.make_model(helper.make_graph([node], "gqa", inputs, outputs, initializers),
                             opset_imports=[helper.make_opsetid("", 21),
                                            helper.make_opsetid("com.microsoft", 1)])


def _model(system: str, heads: int, kv_heads: int, size: int, positions: int) -> bytes:
    bits = {"float32": 32, "int8": 8, "int4": 4, "int8t": 8, "int8-noflash": 8, "int8d": 8,
            "int4d": 4}[system]
    proto = _graph(heads, kv_heads, size, bits, "PER_TENSOR" if system == "int8t"
                   else "PER_CHANNEL", positions)
    if system.endswith("d"):
        model = ir.serde.deserialize_model(proto)
        assert KVPrefillPass("dequantized")(model).modified
        proto = ir.serde.serialize_model(model)
    return proto.SerializeToString()


class _Node:
    """One system's session and its buffers, bound for a forward of `rows` after `past`."""

    def __init__(self, system: str, shape: tuple[int, int, int], past: int, rows: int,
                 threads: int) -> None:
        heads, kv_heads, size = shape
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        saved = os.environ.pop(_NOFLASH, None)
        if system == "int8-noflash":
            os.environ[_NOFLASH] = "1"
        try:
            self.session = ort.InferenceSession(_model(system, heads, kv_heads, size,
                                                       past + rows + 1), options,
                                                providers=["CPUExecutionProvider"])
        finally:
            os.environ.pop(_NOFLASH, None)
            if saved is not None:
                os.environ[_NOFLASH] = saved
        rng = np.random.default_rng(0)
        width = size // 2 if system.startswith("int4") else size
        shape4 = (1, kv_heads, past + rows, width)
        if system == "float32":
            caches = [rng.standard_normal(shape4).astype(np.float32) for _ in range(2)]
        else:
            kind = np.uint8 if system.startswith("int4") else np.int8
            caches = [rng.integers(0, 100, shape4).astype(kind) for _ in range(2)]
        self.kept = [rng.standard_normal((1, rows, (heads + 2 * kv_heads) * size))
                     .astype(np.float32), np.array([past + rows - 1], np.int32),
                     np.array(past + rows, np.int32), *caches]
        self.io = self.session.io_binding()
        for name, array in zip(("qkv", "seqlens_k", "total"), self.kept):
            self.io.bind_cpu_input(name, array)
        for index, (past_name, present_name) in enumerate((("past_key", "present_key"),
                                                           ("past_value", "present_value"))):
            value = ort.OrtValue.ortvalue_from_numpy(caches[index])
            self.kept.append(value)
            self.io.bind_ortvalue_input(past_name, value)
            self.io.bind_ortvalue_output(present_name, value)
        self.io.bind_output("out")

    def run(self) -> float:
        began = time.perf_counter()
        self.session.run_with_iobinding(self.io)
        return time.perf_counter() - began


def measure(systems: list[str], shape: tuple[int, int, int], past: int, rows: int,
            repeats: int, threads: int) -> dict[str, dict[str, float]]:
    """Per system: median, min and max seconds of `repeats` forwards (after a warm-up one),
    alternated system by system, and the median's GMAC/s (Q K^T and softmax x V over every
    query row and every position, the work a kernel without causal skipping does)."""
    nodes = {system: _Node(system, shape, past, rows, threads) for system in systems}
    times: dict[str, list[float]] = {system: [] for system in systems}
    for node in nodes.values():
        node.run()
    for repeat in range(repeats):
        for index in range(len(systems)):
            system = systems[(repeat + index) % len(systems)]
            times[system].append(nodes[system].run())
    heads, _, size = shape
    macs = 2 * heads * size * rows * (past + rows)
    return {system: {"median": statistics.median(values), "min": min(values),
                     "max": max(values), "gmacs": macs / statistics.median(values) / 1e9}
            for system, values in times.items()}
