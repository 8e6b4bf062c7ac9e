"""The real-size benchmark models: their shapes, names and where they are cached.

scripts/make_bench_models.py builds them; every benchmark script finds one by name through
`bench_model` (``--model qwen05-int4``). Standard library only: the exporters venv imports it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "ONNX_CHUNK_BENCH_MODELS"
DEFAULT_ROOT = Path.home() / ".cache" / "onnx-chunk" / "bench-models"
# genai's search.max_length in the exports: the longest benchmark request (4000-token prompt and
# its new tokens) fits, and genai's preallocated KV cache is not the full context's.
MAX_LENGTH = 8192
ONNX_PRECISIONS = ("int4", "fp32", "int4f", "int4h8")
# The builder's arguments of each ONNX precision: ``int4f`` is the INT4 export with a float32
# lm_head and embedding (the builder's `nodes_to_exclude` and `shared_embeddings`), which
# scripts/bench_int4_accuracy.py sets beside the plain INT4 one; ``int4h8`` the INT4 export with
# an 8-bit lm_head (the builder's `matmul_mixed_precision=last_matmul:int8`, its answer to
# llama.cpp writing the output tensor at more bits than the layers). Its embedding stays apart
# (`shared_embeddings=false`): for a tied model onnxruntime-genai 0.18.0's builder otherwise
# writes an embedding that reads two initializers it never saves, which convert refuses.
BUILDER_PRECISION_ARGS = {
    "int4": ("-p", "int4"), "fp32": ("-p", "fp32"),
    "int4f": ("-p", "int4", "--extra_options", "nodes_to_exclude=/lm_head/MatMul",
              "shared_embeddings=false"),
    "int4h8": ("-p", "int4", "--extra_options", "matmul_mixed_precision=last_matmul:int8",
               "shared_embeddings=false")}
GGUF_QUANTS = ("q4_0", "q8_0")
BUILD_COMMAND = "python scripts/make_bench_models.py"


@dataclass(frozen=True)
class Shape:
    """One real model's architecture, with random weights."""

    model_type: str
    config: dict
    tokenizer_family: str  # the export fixtures' tokenizer and chat template
    gguf_pre_tokenizer: str  # the name llama.cpp gives the real model's pre-tokenizer


SHAPES = {
    "qwen05": Shape("qwen2", {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "use_sliding_window": False, "initializer_range": 0.02},
        "qwen2", "qwen2"),
    "llama1b": Shape("llama", {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "initializer_range": 0.02},
        "llama", "llama-bpe"),
}
# Decoders trained here for one behaviour rather than given random weights: shape -> the
# precisions built (fp32 builder exports) and the module that trains the checkpoint. ``copy``:
# a small Llama trained to continue periodic sequences (_bench/copy_decoder.py), the workload
# where prompt-lookup drafts are kept; ``copyq05`` the same recipe widened exactly to the
# qwen05 shape (_bench/copy_decoder_qwen05.py), so that speculation is measured at real size.
# ``text``: a small Llama trained on the English licence
# texts Debian ships (_bench/text_decoder.py), the quantized KV cache's accuracy benchmark; its
# INT4 export (the builder's MatMulNBits, block 32) measures what re-blocked 4-bit weights cost,
# its GGUF files (``f32``: the converter's float32; ``q4_0``: llama.cpp's quantizer) what
# llama.cpp's Q4_0 costs (scripts/bench_int4_accuracy.py --llamacpp). llama.cpp's Q4_0 writes
# the output (lm_head) tensor at Q6_K; ``q4_0h4`` writes it at Q4_0 too, as the builder's INT4
# export writes its lm_head at 4 bits.
TRAINED_SHAPES = {"copy": (("fp32",), "copy_decoder"),
                  "copyq05": (("int4",), "copy_decoder_qwen05"),
                  "text": (("fp32", "int4", "int4f", "int4h8", "f32", "q4_0", "q4_0h4"),
                           "text_decoder")}
# The pre-tokenizer name llama.cpp's converter is given for a trained shape's own byte-level BPE
# (its GGUF files are fed token ids; the name only has to be one the converter knows).
TRAINED_GGUF_PRE_TOKENIZER = {"text": "llama-bpe"}
BENCH_MODELS = tuple(f"{shape}-{precision}" for shape in SHAPES
                     for precision in ONNX_PRECISIONS + GGUF_QUANTS) + tuple(
    f"{shape}-{precision}" for shape, (precisions, _) in TRAINED_SHAPES.items()
    for precision in precisions)


class BenchModelMissing(LookupError):
    """A benchmark model named on the command line is not built (or not a known name)."""


def parse_name(name: str) -> tuple[str, str]:
    """(shape, precision) of a model name such as ``qwen05-int4``."""
    shape, _, precision = name.partition("-")
    if name not in BENCH_MODELS:
        raise BenchModelMissing(f"unknown benchmark model {name!r}; known: "
                                f"{', '.join(BENCH_MODELS)}")
    return shape, precision


def models_root(root: Path | None = None) -> Path:
    """The cache folder: `root`, else $ONNX_CHUNK_BENCH_MODELS, else the default."""
    if root is not None:
        return root
    return Path(os.environ[ROOT_ENV]) if os.environ.get(ROOT_ENV) else DEFAULT_ROOT


def bench_model(name: str, root: Path | None = None) -> Path:
    """The built model `name`: model.onnx of a builder export, or the .gguf file."""
    _, precision = parse_name(name)
    folder = models_root(root) / name
    path = (folder / "model.onnx" if precision in ONNX_PRECISIONS
            else folder / f"{name}.gguf")
    if not ((folder / "BUILD.json").is_file() and path.is_file()):
        raise BenchModelMissing(f"benchmark model {name} is not built in {folder.parent}; "
                                f"build it with `{BUILD_COMMAND} {name}` (see its --help)")
    return path


def model_folder(given: str) -> Path:
    """`given` as a model folder when it is one, else the folder of the built ONNX benchmark
    model of that name (BenchModelMissing when it is not built)."""
    if Path(given).is_dir():
        return Path(given)
    return bench_model(given).parent


def gguf_twins(name: str) -> list[str]:
    """The GGUF names of an ONNX model's shape: ``qwen05-int4`` -> qwen05-q4_0, qwen05-q8_0."""
    shape, _ = parse_name(name)
    return [f"{shape}-{quant}" for quant in GGUF_QUANTS]
