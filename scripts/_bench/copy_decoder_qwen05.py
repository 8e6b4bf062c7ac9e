"""The copy decoder at Qwen2.5-0.5B's shape: the `copyq05-int4` benchmark model's checkpoint.

`copy-fp32` (copy_decoder) keeps prompt-lookup drafts at the cost of a ~64M-parameter decoder;
a verification's cost against a decode step depends on the model's size, so speculative decoding
is measured at real size on this one. It is copy_decoder's recipe (periodic sequences, the same
steps and seed) trained with 2 heads of 64 instead of 4 of 32, so that it widens exactly into
the qwen05 shape of _bench.models, whose attention has 2 KV heads of 64:

- trained head h (MHA: a KV head of its own) becomes the first query head of KV group h, its
  K and V rows the group's; every other query head is zero (q_proj rows, o_proj columns);
- the hidden size (128 to 896), the MLP (512 to 4864) and the vocabulary (512 to 151936, tied)
  are widened with zeros and the norms rescaled, as copy_decoder.grown does; the added ids'
  embedding rows are zero, so their logits are exactly 0 and never the greedy choice (the
  trained ids' best logit is far above it);
- 22 zero-output layers follow the 2 trained ones (random q/k/v, gate and up projections, zero
  o_proj and down_proj): 24 layers.

That is 494M parameters, what Qwen2.5-0.5B has, as a Llama (no q/k/v biases). Each forward
reads and computes what a qwen05 forward does, and greedy decoding copies a periodic prompt's
period: the trained model continues held-out periods of 8 to 48 ids with 80% of tokens right
(64 sequences of 160 tokens; the 4-head copy-fp32 more), fewer past the periods it was trained
on. Standard library at import time, like copy_decoder.
"""

from __future__ import annotations

import math
from pathlib import Path

from . import copy_decoder as base
from .models import SHAPES

TRAINED_HEADS = 2  # one per KV group of the qwen05 shape
CONFIG = dict(base.CONFIG, num_attention_heads=TRAINED_HEADS,
              num_key_value_heads=TRAINED_HEADS)
HEAD_DIM = base.HIDDEN // TRAINED_HEADS
_SHAPE = SHAPES["qwen05"].config


def export_config() -> dict:
    """The exported decoder's config: qwen05's sizes, the trained model's rope and norm eps
    (scaled with the hidden size as copy_decoder.export_config scales it)."""
    hidden = _SHAPE["hidden_size"]
    return dict(CONFIG, vocab_size=_SHAPE["vocab_size"], hidden_size=hidden,
                intermediate_size=_SHAPE["intermediate_size"],
                num_attention_heads=_SHAPE["num_attention_heads"],
                num_key_value_heads=_SHAPE["num_key_value_heads"], head_dim=HEAD_DIM,
                num_hidden_layers=_SHAPE["num_hidden_layers"],
                rms_norm_eps=CONFIG["rms_norm_eps"] * base.HIDDEN / hidden)


def query_heads() -> dict[int, int]:
    """Trained query head -> the exported one: the first of each KV group."""
    group = _SHAPE["num_attention_heads"] // _SHAPE["num_key_value_heads"]
    return {head: head * group for head in range(TRAINED_HEADS)}


def grown(model):
    """The trained `model` widened exactly to export_config() (the module's docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = export_config()
    if _SHAPE["hidden_size"] // _SHAPE["num_attention_heads"] != HEAD_DIM or \
            _SHAPE["num_key_value_heads"] != TRAINED_HEADS:
        raise ValueError(f"the qwen05 shape's attention {_SHAPE} does not take the trained "
                         f"{TRAINED_HEADS} heads of {HEAD_DIM}")
    torch.manual_seed(base.SEED + 1)
    wide = LlamaForCausalLM(LlamaConfig(**config))
    weights = model.state_dict()
    trained_layers = model.config.num_hidden_layers
    gain = math.sqrt(base.HIDDEN / config["hidden_size"])
    size, hidden = HEAD_DIM, base.HIDDEN
    with torch.no_grad():
        for name, parameter in wide.named_parameters():
            parts = name.split(".")
            if parts[1] == "layers" and int(parts[2]) >= trained_layers:
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    parameter.zero_()
                continue
            value = weights[name]
            parameter.zero_()
            if name.endswith("q_proj.weight"):
                for source, target in query_heads().items():
                    parameter[target * size:(target + 1) * size, :hidden] = \
                        value[source * size:(source + 1) * size]
            elif name.endswith("o_proj.weight"):
                for source, target in query_heads().items():
                    parameter[:hidden, target * size:(target + 1) * size] = \
                        value[:, source * size:(source + 1) * size]
            elif name.endswith("norm.weight"):
                parameter[:hidden] = value * gain
            else:  # K/V (head h stays head h), the MLP and the tied embedding: leading block
                parameter[tuple(slice(0, extent) for extent in value.shape)] = value
    wide.eval()
    return wide


def make_checkpoint(dst: Path, tokenizer, eos_ids: list[int], log=print) -> dict:
    """Train, check, grow and save the qwen05-shaped copy decoder as a HF folder in dst."""
    return base.trained_checkpoint(dst, tokenizer, eos_ids, log, config=CONFIG, grow=grown,
                                   describe=_shape_record)


def _shape_record(model, wide) -> dict:
    zero_layers = export_config()["num_hidden_layers"] - base.TRAINED_LAYERS
    return {"layers": f"{base.TRAINED_LAYERS} trained layers ({TRAINED_HEADS} heads of "
                      f"{HEAD_DIM}, hidden {base.HIDDEN}, widened exactly to the qwen05 shape) "
                      f"+ {zero_layers} zero-output layers (o_proj and down_proj zero)",
            "trained_parameters": base.parameters(model), "parameters": base.parameters(wide)}
