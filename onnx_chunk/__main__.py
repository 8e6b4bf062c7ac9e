from onnx_chunk.cli import run

run()
