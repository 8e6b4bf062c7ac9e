"""The device: the provider, buffers on it, its memory readings and the session factory (the
graph edit behind its row-selecting sessions is onnx_chunk.graph.logits_row)."""
