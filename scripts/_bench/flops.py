"""Floating-point operations of a reference decoder's forward: the useful work of a step.

A multiply-add counts as 2 FLOPs. Per query row: every linear layer (q, k, v, o projections
of an attention layer, in/out projections and the depthwise kernel of a conv layer, the
three MLP matrices) and the lm_head, whose logits the exported decoders return for every
row; the embedding is a gather (0 FLOPs), norms, rotary and softmax are left out (a few
per cent at most). Attention per attention layer and row: QK^T and the weighted sum over the
keys it sees, causal, so the row at position p (0-based) attends to p + 1 keys. Pure: no
ONNX Runtime, tested apart.
"""

from __future__ import annotations

from onnx_chunk.models.config import DecoderConfig


def linear_flops_per_row(config: DecoderConfig) -> int:
    """The FLOPs of one query row through every linear layer and the lm_head."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_size
    kv = config.num_kv_heads * config.head_size
    attention = h * q + 2 * h * kv + q * h
    conv = h * 3 * h + h * config.conv_kernel + h * h
    layers = sum((conv if layer in config.conv_layers else attention) + 3 * h * i
                 for layer in range(config.num_layers))
    return 2 * (layers + h * config.vocab_size)


def attention_flops_per_key(config: DecoderConfig) -> int:
    """The FLOPs one query row spends on one key in all attention layers (QK^T and AV)."""
    return 4 * config.num_heads * config.head_size * len(config.attention_layers)


def forward_flops(config: DecoderConfig, rows: int, past: int = 0, batch: int = 1) -> int:
    """The FLOPs of one forward of `batch` x `rows` new tokens after `past` cached tokens."""
    if rows < 1 or past < 0 or batch < 1:
        raise ValueError(f"a forward needs rows >= 1, past >= 0 and batch >= 1, got rows "
                         f"{rows}, past {past}, batch {batch}")
    keys = rows * past + rows * (rows + 1) // 2
    return batch * (rows * linear_flops_per_row(config) + keys * attention_flops_per_key(config))


def generation_flops(config: DecoderConfig, prompt_tokens: int, new_tokens: int
                     ) -> tuple[int, int]:
    """(prefill, decode) FLOPs of one greedy generation: the prompt's rows (however they are
    chunked: causal attention makes the sum the same), then new_tokens - 1 decode forwards
    (the first new token comes from the prefill)."""
    prefill = forward_flops(config, prompt_tokens)
    decode = sum(forward_flops(config, 1, past=prompt_tokens + step)
                 for step in range(new_tokens - 1))
    return prefill, decode
