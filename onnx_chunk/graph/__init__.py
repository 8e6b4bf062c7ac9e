"""The decoder's ONNX file and every edit of its graph that loading makes, below both the passes
and the runtime: the protobuf wire reader (`onnx_wire`), what loading reads of a file
(`model_file`, `data_types`), model folders as onnxruntime-genai reads them (`model_folder`),
loading and saving on onnx_ir (`model_io`), the chunked-prefill plan (`chunk_plan`) and how a
file carries it (`metadata`), ONNX Runtime's native chunks (`query_seqlens`), and the load-time
edits of the serialized graph (`graph_edit`, `logits_row`, `without_query_seqlens`). The
convert-time edits are the passes (onnx_chunk.passes), which build on these."""
