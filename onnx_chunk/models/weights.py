"""Seeded random float32 weights of a reference decoder, free of any ONNX code.

Every linear weight is stored as [in_features, out_features], so a layer computes `x @ w`.
The draw order is fixed (embedding, then each layer in order, final norm, lm_head), so the
same config and seed always give the same arrays; the static-graph builder relies on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_chunk.models.config import DecoderConfig


@dataclass(frozen=True)
class AttentionWeights:
    """GQA projections: q [h, heads*d], k and v [h, kv_heads*d], o [heads*d, h]."""

    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray


@dataclass(frozen=True)
class ConvWeights:
    """LFM2-style short conv: in_proj [h, 3h] -> (b, c, x); kernel [h, k]; out_proj [h, h]."""

    in_proj: np.ndarray
    kernel: np.ndarray
    out_proj: np.ndarray


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: norm, mixer (attention or conv), norm, SwiGLU MLP."""

    input_norm: np.ndarray
    mixer: AttentionWeights | ConvWeights
    post_norm: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray


@dataclass(frozen=True)
class DecoderWeights:
    """All weights: embedding [vocab, h], layers, final norm [h], lm_head [h, vocab]."""

    embedding: np.ndarray
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray
    lm_head: np.ndarray


def _linear(rng: np.random.Generator, fan_in: int, fan_out: int, gain: float = 1.0) -> np.ndarray:
    weight = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
    weight *= np.float32(gain / np.sqrt(fan_in))
    return weight


def _norm(rng: np.random.Generator, size: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)


def make_weights(config: DecoderConfig, seed: int) -> DecoderWeights:
    """Draw every weight of `config` from a generator seeded with `seed`.

    Projections are scaled by 1/sqrt(fan_in) so activations stay near unit scale at any size,
    and lm_head by 2/sqrt(hidden) so logits spread enough for greedy decoding to be stable.
    """
    config.validate()
    rng = np.random.default_rng(seed)
    h, inter = config.hidden_size, config.intermediate_size
    q_width = config.num_heads * config.head_size
    kv_width = config.num_kv_heads * config.head_size
    embedding = rng.standard_normal((config.vocab_size, h), dtype=np.float32)
    layers = []
    for layer in range(config.num_layers):
        input_norm = _norm(rng, h)
        mixer: AttentionWeights | ConvWeights
        if layer in config.conv_layers:
            kernel = rng.standard_normal((h, config.conv_kernel), dtype=np.float32)
            kernel *= np.float32(1.0 / np.sqrt(config.conv_kernel))
            mixer = ConvWeights(in_proj=_linear(rng, h, 3 * h), kernel=kernel,
                                out_proj=_linear(rng, h, h))
        else:
            mixer = AttentionWeights(q_proj=_linear(rng, h, q_width),
                                     k_proj=_linear(rng, h, kv_width),
                                     v_proj=_linear(rng, h, kv_width),
                                     o_proj=_linear(rng, q_width, h))
        layers.append(LayerWeights(input_norm=input_norm, mixer=mixer, post_norm=_norm(rng, h),
                                   gate_proj=_linear(rng, h, inter), up_proj=_linear(rng, h, inter),
                                   down_proj=_linear(rng, inter, h)))
    final_norm = _norm(rng, h)
    lm_head = _linear(rng, h, config.vocab_size, gain=2.0)
    return DecoderWeights(embedding=embedding, layers=tuple(layers), final_norm=final_norm,
                          lm_head=lm_head)
