"""A NumPy forward of a reference decoder, written from the math and never calling ORT.

It reads the weights out of the ONNX file (dequantizing MatMulNBits for INT4) but computes the
rotary tables itself from rope_theta, so a wrong cos/sin cache in the file shows up as a
mismatch. It is the ground truth for a built model, and for any graph pass that must not
change the numbers. Everything is computed in float64; logits are returned as float32.
A float16 decoder's weights are read as stored (already rounded to float16) and widened, so
the reference shows what the float16 graph would give without its float16 rounding of every
activation; docs/models.md documents the tolerance that rounding needs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_chunk.errors import InputError, ModelLoadError, ModelStructureError
from onnx_chunk.models.config import DecoderConfig
from onnx_chunk.models.decoder_graph import METADATA_KEY, linear_output_name
from onnx_chunk.models.genai_config import EMBEDDINGS_FILENAME, MODEL_FILENAME
from onnx_chunk.models.variants import VariantSpec, variant_spec


@dataclass
class DecoderState:
    """What a decoder carries between calls: KV per GQA layer, conv columns per conv layer.

    keys/values are [batch, kv_heads, length, head_size]; conv is [batch, hidden, k-1].
    """

    keys: dict[int, np.ndarray] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    conv: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Number of positions already in the KV cache."""
        return next(iter(self.keys.values())).shape[2] if self.keys else 0

    @classmethod
    def empty(cls, config: DecoderConfig, batch: int = 1) -> DecoderState:
        kv = (batch, config.num_kv_heads, 0, config.head_size)
        conv = (batch, config.hidden_size, config.conv_kernel - 1)
        return cls(keys={i: np.zeros(kv) for i in config.attention_layers},
                   values={i: np.zeros(kv) for i in config.attention_layers},
                   conv={i: np.zeros(conv) for i in config.conv_layers})


@dataclass(frozen=True)
class _Layer:
    input_norm: np.ndarray
    post_norm: np.ndarray
    mixer: dict[str, np.ndarray]
    mlp: dict[str, np.ndarray]


def dequantize_matmul_nbits(packed: np.ndarray, scales: np.ndarray,
                            zero_points: np.ndarray | None, k: int, n: int, bits: int,
                            block_size: int) -> np.ndarray:
    """The [K, N] float weight a `com.microsoft::MatMulNBits` node multiplies by (4 bits)."""
    if bits != 4:
        raise ModelStructureError(f"MatMulNBits with {bits} bits is not supported; "
                                  "expected 4-bit weights")
    blocks = (k + block_size - 1) // block_size
    raw = packed.reshape(n, blocks, block_size // 2)
    quants = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, blocks, block_size)
    scale = scales.reshape(n, blocks, 1).astype(np.float64)
    if zero_points is None:
        zero = np.full((n, blocks, 1), 8.0)
    elif zero_points.dtype == np.uint8:
        zp = zero_points.reshape(n, -1)
        zero = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks, None]
    else:
        zero = zero_points.reshape(n, blocks, 1).astype(np.float64)
    weight = (quants.astype(np.float64) - zero) * scale
    return weight.reshape(n, blocks * block_size)[:, :k].T


def _rms(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def rotary_tables(config: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_size/2] in float64: angle(p, i) = p * theta^(-2i/head_size)."""
    half = config.head_size // 2
    exponents = np.arange(half, dtype=np.float64) * 2.0 / config.head_size
    frequencies = np.power(float(config.rope_theta), -exponents)
    angles = np.arange(config.max_positions, dtype=np.float64)[:, None] * frequencies[None, :]
    return np.cos(angles), np.sin(angles)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split rotary on x [B, S, heads, d] with cos/sin [B, S, d/2]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class ReferenceDecoder:
    """The math of a reference decoder over NumPy arrays, with weights read from its file.

    `cos`/`sin` are the rotary tables computed from the config, never read from the file.
    """

    def __init__(self, config: DecoderConfig, spec: VariantSpec, embedding: np.ndarray,
                 layers: list[_Layer], final_norm: np.ndarray, lm_head: np.ndarray) -> None:
        self.config = config
        self.spec = spec
        self.embedding = embedding
        self._layers = layers
        self._final_norm = final_norm
        self._lm_head = lm_head
        self.cos, self.sin = rotary_tables(config)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> ReferenceDecoder:
        """Load from a model folder or its model.onnx (weights from the ONNX file itself)."""
        model_path = Path(path)
        if model_path.is_dir():
            model_path = model_path / MODEL_FILENAME
        try:
            model = onnx.load(str(model_path), load_external_data=True)
        except Exception as error:
            raise ModelLoadError(f"cannot load {model_path}: {error}; build it with "
                                 "`onnx-chunk build-model`") from error
        props = {prop.key: prop.value for prop in model.metadata_props}
        if METADATA_KEY not in props:
            raise ModelStructureError(
                f"{model_path} has no {METADATA_KEY!r} metadata; only decoders written by "
                "onnx_chunk.models.build_decoder have a NumPy reference")
        meta = json.loads(props[METADATA_KEY])
        fields = dict(meta["config"])
        fields["conv_layers"] = tuple(fields["conv_layers"])
        config = DecoderConfig(**fields).validate()
        spec = variant_spec(meta["variant"])
        tensors = {init.name: init for init in model.graph.initializer}
        producers = {out: node for node in model.graph.node for out in node.output}

        def array(name: str) -> np.ndarray:
            if name not in tensors:
                raise ModelStructureError(f"{model_path} lacks the initializer {name!r}")
            return numpy_helper.to_array(tensors[name])

        def linear(layer: int | None, module: str) -> np.ndarray:
            output = linear_output_name(layer, module)
            node = producers.get(output)
            if node is None:
                raise ModelStructureError(f"{model_path}: no node writes {output!r}")
            if node.op_type == "MatMul":
                return array(node.input[1]).astype(np.float64)
            if node.op_type == "MatMulNBits":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                zero = array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
                return dequantize_matmul_nbits(array(node.input[1]), array(node.input[2]), zero,
                                               attrs["K"], attrs["N"], attrs["bits"],
                                               attrs["block_size"])
            raise ModelStructureError(f"{model_path}: {output!r} comes from a {node.op_type} "
                                      "node; expected MatMul or MatMulNBits")

        if spec.inputs_embeds:
            embeddings_path = model_path.parent / EMBEDDINGS_FILENAME
            if not embeddings_path.exists():
                raise ModelLoadError(f"{embeddings_path} is missing; the inputs_embeds "
                                     "variant keeps its embedding table there")
            embedding = np.load(embeddings_path)
        else:
            embedding = array("model.embed_tokens.weight")
        layers = []
        for layer in range(config.num_layers):
            stem = f"model.layers.{layer}"
            if layer in config.conv_layers:
                kernel = array(f"{stem}.conv.conv.weight").reshape(config.hidden_size, -1)
                mixer = {"in_proj": linear(layer, "conv/in_proj"), "kernel": kernel,
                         "out_proj": linear(layer, "conv/out_proj")}
            else:
                mixer = {name: linear(layer, f"attn/{name}")
                         for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
            mlp = {name: linear(layer, f"mlp/{name}")
                   for name in ("gate_proj", "up_proj", "down_proj")}
            layers.append(_Layer(input_norm=array(f"{stem}.input_layernorm.weight"),
                                 post_norm=array(f"{stem}.post_attention_layernorm.weight"),
                                 mixer=mixer, mlp=mlp))
        return cls(config, spec, embedding, layers, array("model.norm.weight"),
                   linear(None, "lm_head"))

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """Embedding rows [B, S, hidden] for token ids [B, S]."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise InputError(f"token ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return self.embedding[ids]

    def forward(self, input_ids: np.ndarray | None = None, *,
                inputs_embeds: np.ndarray | None = None,
                positions: np.ndarray | None = None,
                state: DecoderState | None = None,
                row_scale: np.ndarray | None = None) -> tuple[np.ndarray, DecoderState]:
        """Run S new rows after `state` and return (logits float32, the new state).

        Pass token ids [B, S] or embeddings [B, S, hidden]. `positions` [B, S] are the rotary
        positions (default: state.length + arange(S)); `row_scale` [S] is the odd_port
        variant's per-row factor. Logits are [B, S, vocab], or [B, 1, vocab] for the
        last_token_logits variant, like the model's output.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise InputError("pass exactly one of input_ids and inputs_embeds")
        hidden = (self.embed(input_ids) if input_ids is not None
                  else np.asarray(inputs_embeds, dtype=np.float64))
        hidden = hidden.astype(np.float64)
        batch, rows = hidden.shape[:2]
        state = state if state is not None else DecoderState.empty(self.config, batch)
        past = state.length
        if positions is None:
            positions = np.broadcast_to(np.arange(past, past + rows), (batch, rows))
        positions = np.asarray(positions, dtype=np.int64)
        if positions.max(initial=0) >= self.config.max_positions:
            raise InputError(f"position {positions.max()} is past max_positions "
                             f"{self.config.max_positions}")
        if row_scale is not None:
            hidden = hidden * np.asarray(row_scale, dtype=np.float64)[:, None]
        new_state = DecoderState()
        eps = self.config.rms_norm_eps
        for index, layer in enumerate(self._layers):
            normed = _rms(hidden, layer.input_norm, eps)
            if index in self.config.conv_layers:
                mixed, new_state.conv[index] = self._conv(layer.mixer, normed, state.conv[index])
            else:
                mixed, key, value = self._attention(layer.mixer, normed, positions,
                                                    state.keys[index], state.values[index])
                new_state.keys[index], new_state.values[index] = key, value
            hidden = hidden + mixed
            normed = _rms(hidden, layer.post_norm, eps)
            gate = normed @ layer.mlp["gate_proj"]
            silu = gate / (1.0 + np.exp(-gate))
            hidden = hidden + (silu * (normed @ layer.mlp["up_proj"])) @ layer.mlp["down_proj"]
        hidden = _rms(hidden, self._final_norm, eps)
        if self.spec.last_token_logits:
            hidden = hidden[:, -1:]
        return (hidden @ self._lm_head).astype(np.float32), new_state

    def _attention(self, weights: dict[str, np.ndarray], x: np.ndarray, positions: np.ndarray,
                   past_key: np.ndarray, past_value: np.ndarray):
        config = self.config
        batch, rows, _ = x.shape
        d = config.head_size
        q = (x @ weights["q_proj"]).reshape(batch, rows, config.num_heads, d)
        k = (x @ weights["k_proj"]).reshape(batch, rows, config.num_kv_heads, d)
        v = (x @ weights["v_proj"]).reshape(batch, rows, config.num_kv_heads, d)
        cos, sin = self.cos[positions], self.sin[positions]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = np.concatenate([past_key, k.transpose(0, 2, 1, 3)], axis=2)
        values = np.concatenate([past_value, v.transpose(0, 2, 1, 3)], axis=2)
        group = config.num_heads // config.num_kv_heads
        expanded_k = np.repeat(keys, group, axis=1)
        expanded_v = np.repeat(values, group, axis=1)
        scores = np.einsum("bshd,bhtd->bhst", q, expanded_k) / np.sqrt(d)
        total = keys.shape[2]
        past = total - rows
        visible = np.arange(total)[None, :] <= (past + np.arange(rows))[:, None]
        scores = np.where(visible, scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attended = np.einsum("bhst,bhtd->bshd", probs, expanded_v).reshape(batch, rows, -1)
        return attended @ weights["o_proj"], keys, values

    def _conv(self, weights: dict[str, np.ndarray], x: np.ndarray, past: np.ndarray):
        hidden_size = self.config.hidden_size
        width = self.config.conv_kernel
        projected = x @ weights["in_proj"]
        b_gate = projected[..., :hidden_size]
        c_gate = projected[..., hidden_size:2 * hidden_size]
        signal = projected[..., 2 * hidden_size:]
        window = np.concatenate([past, (b_gate * signal).transpose(0, 2, 1)], axis=2)
        rows = x.shape[1]
        convolved = sum(window[:, :, j:j + rows] * weights["kernel"][None, :, j:j + 1]
                        for j in range(width))
        new_state = window[:, :, window.shape[2] - (width - 1):]
        return (c_gate * convolved.transpose(0, 2, 1)) @ weights["out_proj"], new_state

    def greedy(self, prompt: list[int] | np.ndarray, steps: int) -> list[int]:
        """Greedy tokens after `prompt` (batch 1): one prompt forward, then one row a step.

        The inputs_embeds variant embeds with its own table; odd_port uses a row scale of 1.
        """
        ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
        state = None
        tokens: list[int] = []
        for _ in range(steps):
            kwargs = {"row_scale": np.ones(ids.shape[1])} if self.spec.odd_port else {}
            if self.spec.inputs_embeds:
                logits, state = self.forward(inputs_embeds=self.embed(ids), state=state,
                                             **kwargs)
            else:
                logits, state = self.forward(ids, state=state, **kwargs)
            token = int(np.argmax(logits[0, -1]))
            tokens.append(token)
            ids = np.array([[token]], dtype=np.int64)
        return tokens


