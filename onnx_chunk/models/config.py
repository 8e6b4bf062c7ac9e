"""Sizes of a reference decoder: a frozen dataclass validated once, and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onnx_chunk.errors import ConfigError

# The most weights a reference decoder may have: building one holds its float32 draws in
# memory (4 GiB here, ten times the bench preset), so larger sizes are refused before any
# allocation.
MAX_PARAMETERS = 1 << 30


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a Llama-style GQA decoder (optionally with LFM2-style short-conv layers).

    `conv_layers` lists the layers that are causal depthwise-conv layers instead of attention
    layers; `conv_kernel` is their kernel width k (their carried state holds k-1 columns).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 3
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def validate(self) -> DecoderConfig:
        """Raise ConfigError for sizes no decoder can have; return self for chaining."""
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size",
                    "intermediate_size", "vocab_size", "max_positions")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}; "
                                  "pass a size of at least 1")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}); "
                "choose a kv head count that is a divisor of the head count")
        if self.head_size % 2:
            raise ConfigError(f"head_size must be even for rotary embeddings, got "
                              f"{self.head_size}; choose an even head size")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError(f"rope_theta and rms_norm_eps must be positive, got "
                              f"{self.rope_theta!r} and {self.rms_norm_eps!r}")
        if self.conv_kernel < 2:
            raise ConfigError(f"conv_kernel must be at least 2 (the state keeps k-1 columns), "
                              f"got {self.conv_kernel}")
        bad = [i for i in self.conv_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.conv_layers)) != len(self.conv_layers):
            raise ConfigError(f"conv_layers {self.conv_layers} must be distinct layer indices "
                              f"in [0, {self.num_layers})")
        if len(self.conv_layers) == self.num_layers:
            raise ConfigError("at least one layer must be an attention layer; "
                              "leave one layer out of conv_layers")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name} ({getattr(self, name)}) must lie in "
                                  f"[0, vocab_size={self.vocab_size})")
        count = self.parameter_count()
        if count > MAX_PARAMETERS:
            raise ConfigError(
                f"these sizes make a decoder of {count:,} parameters ({count * 4 / 2**30:,.1f} "
                f"GiB of float32 weights to build), above the {MAX_PARAMETERS:,} a reference "
                "decoder may have; choose smaller sizes (--hidden, --vocab, --layers, "
                "--intermediate)")
        return self

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the GQA layers (every layer that is not a conv layer)."""
        return tuple(i for i in range(self.num_layers) if i not in self.conv_layers)

    def parameter_count(self) -> int:
        """Number of weights: embedding, layers, final norm and lm_head (not rotary caches)."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        attention = h * q + 2 * h * kv + q * h
        conv = h * 3 * h + h * self.conv_kernel + h * h
        mlp = 3 * h * i
        layers = sum((conv if layer in self.conv_layers else attention) + mlp + 2 * h
                     for layer in range(self.num_layers))
        return 2 * self.vocab_size * h + layers + h


PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_size=16, intermediate_size=128, vocab_size=256,
                          max_positions=2048),
    "small": DecoderConfig(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2,
                           head_size=32, intermediate_size=768, vocab_size=4096,
                           max_positions=4096),
    "bench": DecoderConfig(num_layers=8, hidden_size=768, num_heads=12, num_kv_heads=4,
                           head_size=64, intermediate_size=2048, vocab_size=32000,
                           max_positions=4096),
}

_OVERRIDABLE = {field.name for field in dataclasses.fields(DecoderConfig)}


def config_for(preset: str, **overrides) -> DecoderConfig:
    """The preset's sizes with `overrides` applied, validated.

    When hidden_size or num_heads is overridden without head_size, head_size follows as
    hidden_size // num_heads, so `config_for("tiny", hidden_size=128)` stays consistent.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    unknown = sorted(set(overrides) - _OVERRIDABLE)
    if unknown:
        raise ConfigError(f"unknown size override(s) {', '.join(unknown)}; "
                          f"expected some of {', '.join(sorted(_OVERRIDABLE))}")
    given = {name: value for name, value in overrides.items() if value is not None}
    base = PRESETS[preset]
    if "head_size" not in given and ("hidden_size" in given or "num_heads" in given):
        hidden = given.get("hidden_size", base.hidden_size)
        heads = given.get("num_heads", base.num_heads)
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            given["head_size"] = hidden // heads
    if "conv_layers" in given:
        given["conv_layers"] = tuple(given["conv_layers"])
    return dataclasses.replace(base, **given).validate()
