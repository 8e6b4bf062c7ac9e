"""Float precision of a reference decoder: float32 (the default) or float16 (for CUDA).

ONNX Runtime's CUDA GroupQueryAttention kernel exists for float16 and bfloat16 only, so a
float32 decoder's attention falls back to the CPU provider on a GPU. onnxruntime-genai's model
builder exports float16 decoders for CUDA for this reason; `float16` here follows its layout:
weights, activations, KV inputs/outputs, cos/sin caches and logits all in float16.
"""

from __future__ import annotations

import numpy as np

from onnx_chunk.errors import ConfigError

DTYPES: tuple[str, ...] = ("float32", "float16")


def float_dtype(name: str) -> np.dtype:
    """The NumPy dtype of precision `name`; ConfigError names the known precisions otherwise."""
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return np.dtype(name)
