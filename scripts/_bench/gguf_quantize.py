"""llama.cpp's own quantizer through llama-cpp-python (run with the llama.cpp venv).

`python gguf_quantize.py INPUT.gguf OUTPUT.gguf TYPE` (TYPE q4_0 or q8_0): llama.cpp's
`llama_model_quantize` with its default parameters, as its llama-quantize tool runs it
(whose Q4_0 writes the output tensor at Q6_K). TYPE q4_0h4: Q4_0 with the output tensor at Q4_0
as well, as `llama-quantize --output-tensor-type q4_0` writes it.
"""

from __future__ import annotations

import sys

import llama_cpp

FILE_TYPES = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "q4_0h4": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
OUTPUT_TYPES = {"q4_0h4": llama_cpp.GGML_TYPE_Q4_0}


def main() -> None:
    source, target, kind = sys.argv[1:]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[kind]
    params.nthread = 2
    if kind in OUTPUT_TYPES:
        params.output_tensor_type = OUTPUT_TYPES[kind]
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize({source} -> {target}, {kind}) returned {status}")


if __name__ == "__main__":
    main()
