"""INT4 weights through ONNX Runtime's own MatMulNBits quantizer (4 bits, block 32)."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from onnx_chunk.errors import ModelLoadError

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32
BITS = 4
# Tensors at least this large go to the external data file; small shape constants stay inline.
EXTERNAL_THRESHOLD_BYTES = 128


def quantize_int4(source: Path, target: Path) -> None:
    """Quantize every MatMul of `source` (model.onnx + data) into `target` with MatMulNBits.

    Uses `MatMulNBitsQuantizer` with block size 32, asymmetric (with zero points), the way
    exported INT4 decoders are made. The target keeps all weights as external data in
    `<target>.data` (all but the small shape constants).
    """
    quantizer_class = _quantizer_class()
    try:
        model = onnx.load(str(source), load_external_data=True)
    except Exception as error:
        raise ModelLoadError(f"cannot load {source} for INT4 quantization: {error}") from error
    quantizer = quantizer_class(model, bits=BITS, block_size=BLOCK_SIZE, is_symmetric=False)
    quantizer.process()
    quantized = quantizer.model.model
    count = sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)
    logger.info("quantized %d MatMul nodes to MatMulNBits (%d bits, block %d)",
                count, BITS, BLOCK_SIZE)
    onnx.save_model(quantized, str(target), save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location=f"{target.name}.data",
                    size_threshold=EXTERNAL_THRESHOLD_BYTES)


def _quantizer_class() -> type:
    """Import the quantizer without letting its module-level logging.basicConfig take over.

    onnxruntime.quantization.matmul_nbits_quantizer calls logging.basicConfig(level=INFO) on
    import; a placeholder root handler makes that a no-op, and the module's logger is held at
    WARNING so a build does not print a line per MatMul.
    """
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.removeHandler(placeholder)
    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)
    return MatMulNBitsQuantizer
