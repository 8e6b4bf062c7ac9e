"""Reference decoders with seeded random weights and onnxruntime-genai's I/O contract."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, OutputError
from onnx_chunk.models.config import PRESETS, DecoderConfig, config_for
from onnx_chunk.models.decoder_graph import build_graph
from onnx_chunk.models.genai_config import EMBEDDINGS_FILENAME, MODEL_FILENAME, genai_config
from onnx_chunk.models.precision import DTYPES, float_dtype
from onnx_chunk.models.quantize import EXTERNAL_THRESHOLD_BYTES, quantize_int4
from onnx_chunk.models.variants import VARIANTS, VariantSpec, variant_spec
from onnx_chunk.models.weights import DecoderWeights, make_weights
from onnx_chunk.staged_output import Staging, staged_write

__all__ = ["DTYPES", "DecoderConfig", "DecoderWeights", "PRESETS", "VARIANTS",
           "EMBEDDINGS_FILENAME", "build_decoder", "config_for", "decoder_config", "make_weights"]

logger = logging.getLogger(__name__)


def decoder_config(preset: str = "tiny", variant: str = "base", **size_overrides) -> DecoderConfig:
    """The validated config build_decoder uses: the preset, the overrides, the variant's layers.

    conv_hybrid turns every even layer (0, 2, ...) into a short-conv layer unless
    `conv_layers` is given.
    """
    spec = variant_spec(variant)
    config = config_for(preset, **size_overrides)
    if spec.conv_hybrid and not config.conv_layers:
        conv_layers = tuple(range(0, config.num_layers, 2))
        config = dataclasses.replace(config, conv_layers=conv_layers).validate()
    return config


def build_decoder(out_dir: str | os.PathLike, preset: str = "tiny", variant: str = "base",
                  seed: int = 0, dtype: str = "float32", **size_overrides) -> Path:
    """Write a reference decoder into `out_dir` and return the path of its model.onnx.

    `dtype` is the precision of weights, activations, KV and logits: float32, or float16 for
    CUDA (its GroupQueryAttention kernel has no float32 version). The weights are the same
    float32 draws for either, rounded to float16 for a float16 decoder.

    The folder gets model.onnx, model.onnx.data (the weights), genai_config.json and, for
    inputs_embeds, embeddings.npy. Everything is written to a temporary folder inside
    `out_dir` first and renamed into place, so no half-written model is ever left behind; a
    failed build removes the folders it created. Same arguments give byte-identical files.
    """
    spec = variant_spec(variant)
    float_dtype(dtype)  # an unknown dtype is a ConfigError before anything is written
    config = decoder_config(preset, variant, **size_overrides)
    out = Path(out_dir)
    try:
        with staged_write(out, MODEL_FILENAME) as staging:
            _write_decoder(staging, config, spec, seed, dtype)
    except OutputError:  # already says what to do; an OSError too, not to be wrapped
        raise
    except OSError as error:
        raise OutputError(f"cannot write the model into {out}: {error.strerror or error}; "
                          "check the folder's permissions and free space") from error
    except MemoryError as error:
        raise ConfigError(f"not enough memory to build a decoder of "
                          f"{config.parameter_count():,} parameters; choose smaller "
                          "sizes") from error
    logger.info("built %s/%s %s decoder (%d parameters) at %s", preset, variant, dtype,
                config.parameter_count(), out / MODEL_FILENAME)
    return out / MODEL_FILENAME


def _write_decoder(staging: Staging, config: DecoderConfig, spec: VariantSpec, seed: int,
                   dtype: str) -> None:
    """Build the decoder's files in `staging`, then publish them (model.onnx last)."""
    weights = make_weights(config, seed)
    model = build_graph(config, weights, spec, seed, dtype)
    fp32_path = staging.path / ("fp32" if spec.int4 else ".") / MODEL_FILENAME
    fp32_path.parent.mkdir(exist_ok=True)
    ir.save(model, fp32_path, external_data=f"{MODEL_FILENAME}.data",
            size_threshold_bytes=EXTERNAL_THRESHOLD_BYTES)
    del model
    if spec.int4:
        quantize_int4(fp32_path, staging.path / MODEL_FILENAME)
        shutil.rmtree(fp32_path.parent)
    if spec.inputs_embeds:
        np.save(staging.path / EMBEDDINGS_FILENAME, weights.embedding.astype(dtype))
    del weights
    (staging.path / "genai_config.json").write_text(
        json.dumps(genai_config(config, spec, dtype), indent=4) + "\n")
    names = [f"{MODEL_FILENAME}.data", "genai_config.json", MODEL_FILENAME]
    if spec.inputs_embeds:
        names.insert(0, EMBEDDINGS_FILENAME)
    staging.publish(names)
