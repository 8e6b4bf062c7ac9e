"""A small Llama decoder trained to copy: the `copy-fp32` benchmark model's checkpoint.

Prompt-lookup speculation only pays where its drafts are kept, and random-weight decoders keep
about half of them. This decoder is trained (torch, CPU, a fixed seed, a few minutes) on
periodic sequences: a block of P distinct random token ids (P drawn from PERIODS, ids from
FIRST_ID..VOCAB_SIZE-1) repeated up to TRAIN_LENGTH, with the loss on every position after the
first period. Its TRAINED_LAYERS layers (hidden HIDDEN, HEADS heads) learn the induction ("copy
what followed the last time this token appeared") behaviour, so greedy decoding continues a
periodic prompt's period and the drafts prompt lookup takes from the prompt are kept. The
embeddings are tied (lm_head is the embedding matrix): untied, the same recipe was still at loss
5.6 (uniform: 6.2) after 850 steps; tied, the loss falls from step 400 and is below 0.3 by step
600 (copying a token is then reading its own embedding back). `copy_accuracy` measures the
copying on held-out periodic prompts (a seed the training never draws).

Such a decoder is almost free to run: a forward's cost would be ONNX Runtime's and onnx_chunk's
fixed overhead rather than compute. The exported checkpoint therefore does the same function
with realistic compute (`grown`): the trained layers widened exactly to EXPORT_HIDDEN (every
trained tensor in the leading block of the wider one, zeros elsewhere, norm gains and eps
rescaled so the widened norms give the same values; the residual stream's extra dimensions stay
zero), followed by ZERO_LAYERS appended layers whose attention and MLP input projections are
random (the initializer's) and whose output projections (o_proj and down_proj) are exactly zero,
so each adds 0 to the residual stream while every forward pays their matmuls and reads their
weights. That is "2 trained layers + 10 zero-output layers", 64.0M parameters (0.59M trained),
257 MB in fp32; `agreement` checks the logits of both against each other (the build refuses a
widened model whose greedy output differs) and BUILD.json records all of it.

EXPORT_HIDDEN is 576 (18 heads of 32), not 512: onnxruntime-genai's model builder takes any
nn.Linear whose out_features equals vocab_size for the lm_head (`has_lm_head`), and with hidden
512 = VOCAB_SIZE it met layer 0's q_proj first and wired the logits to layer 0's
post-attention norm (an export that repeats one token; make_bench_models.py now refuses such a
config for any name). `regrow` re-widens a checkpoint saved at another export shape from its
trained block (no training).

Run by scripts/make_bench_models.py under the exporters venv (torch, transformers); standard
library at import time, so the benchmark scripts can read its constants.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
FIRST_ID = 8  # ids 0-7 are the fixture tokenizer's special tokens
HIDDEN = 128
HEADS = 4
INTERMEDIATE = 512
HEAD_DIM = HIDDEN // HEADS
TRAINED_LAYERS = 2
EXPORT_HIDDEN = 576  # not VOCAB_SIZE: make_bench_models.py's lm_head_clash
EXPORT_INTERMEDIATE = 2304
ZERO_LAYERS = 10
PERIODS = (8, 48)  # the block length P, inclusive
TRAIN_LENGTH = 128
BATCH = 16
STEPS = 2000
LEARNING_RATE = 2e-3
WARMUP = 100
DECAY_FROM = 1500  # constant rate until here, then a cosine to 0
HELD_OUT = 64  # held-out sequences for the copy accuracy
HELD_OUT_NEW_TOKENS = 160
HELD_OUT_SEED = 99
# The largest logit difference a widened (or sliced) decoder may have from the trained one:
# float rounding of the wider sums, far below any change of function.
WIDENED_TOLERANCE = 1e-3

CONFIG = {
    "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "initializer_range": 0.02,
}


def periodic_block(rng: random.Random, period: int) -> list[int]:
    """P distinct ids (no id twice, so the token alone says what follows it)."""
    return rng.sample(range(FIRST_ID, VOCAB_SIZE), period)


def periodic(block: list[int], length: int) -> list[int]:
    """`block` repeated up to `length` ids."""
    return [block[index % len(block)] for index in range(length)]


def _batch(rng: random.Random):
    """A training batch: ids [BATCH, TRAIN_LENGTH] and the mask of the positions whose next token
    is scored (those whose target follows an earlier occurrence of the current id)."""
    import torch

    ids = torch.empty((BATCH, TRAIN_LENGTH), dtype=torch.long)
    scored = torch.zeros((BATCH, TRAIN_LENGTH - 1), dtype=torch.bool)
    for row in range(BATCH):
        period = rng.randint(*PERIODS)
        ids[row] = torch.tensor(periodic(periodic_block(rng, period), TRAIN_LENGTH))
        # Logits at t predict id t + 1; from id period + 1 on it follows an earlier occurrence
        # of id t (id `period`, the first repeat, follows an id seen once).
        scored[row, period:] = True
    return ids, scored


def train(log=print, config: dict | None = None):
    """The trained TRAINED_LAYERS-layer LlamaForCausalLM and a record of its training; `config`
    replaces CONFIG (copy_decoder_qwen05 trains 2 heads of 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    config = LlamaConfig(**(CONFIG if config is None else config),
                         num_hidden_layers=TRAINED_LAYERS)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0,
                                  betas=(0.9, 0.98))

    def rate(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        if step < DECAY_FROM:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - DECAY_FROM) / (STEPS - DECAY_FROM)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    began = time.monotonic()
    losses = []
    model.train()
    for step in range(STEPS):
        ids, scored = _batch(rng)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[scored], ids[:, 1:][scored])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == STEPS - 1:
            log(f"  step {step}/{STEPS}: loss {loss.item():.4f} "
                f"({time.monotonic() - began:.0f} s)")
    model.eval()
    return model, {"steps": STEPS, "batch": BATCH, "train_length": TRAIN_LENGTH,
                   "periods": list(PERIODS), "learning_rate": LEARNING_RATE,
                   "warmup": WARMUP, "decay_from": DECAY_FROM,
                   "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 5),
                   "train_s": round(time.monotonic() - began, 1)}


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's greedy continuation of `prompt` (KV cache, no stop token): the torch
    checkpoint's own loop, as it is trained and before any export runs on onnx_chunk."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past, produced = out.past_key_values, []
        token = int(out.logits[0, -1].argmax())
        for _ in range(new_tokens):
            produced.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return produced


def copy_accuracy(model, sequences: int = HELD_OUT, new_tokens: int = HELD_OUT_NEW_TOKENS
                  ) -> dict:
    """Greedy continuation of held-out periodic prompts (1.5 to 2 periods, ids from a seed the
    training never drew) against the true continuation of the period: the share of tokens
    right, and the share of sequences right in full."""
    rng = random.Random(HELD_OUT_SEED)
    right = total = whole = 0
    for _ in range(sequences):
        period = rng.randint(*PERIODS)
        length = rng.randint(period * 3 // 2, period * 2)
        sequence = periodic(periodic_block(rng, period), length + new_tokens)
        produced = greedy(model, sequence[:length], new_tokens)
        hits = sum(a == b for a, b in zip(produced, sequence[length:]))
        right, total, whole = right + hits, total + new_tokens, whole + (hits == new_tokens)
    return {"sequences": sequences, "new_tokens": new_tokens, "token_accuracy": right / total,
            "sequences_exact": whole / sequences}


def export_config(trained_layers: int = TRAINED_LAYERS) -> dict:
    """The exported decoder's config: the trained one widened to EXPORT_HIDDEN (same head size,
    more heads, EXPORT_INTERMEDIATE), with ZERO_LAYERS more layers; rms_norm_eps scaled with the
    hidden size so that the widened norms divide by the same root mean square."""
    return dict(CONFIG, hidden_size=EXPORT_HIDDEN, intermediate_size=EXPORT_INTERMEDIATE,
                num_attention_heads=EXPORT_HIDDEN // HEAD_DIM,
                num_key_value_heads=EXPORT_HIDDEN // HEAD_DIM, head_dim=HEAD_DIM,
                rms_norm_eps=CONFIG["rms_norm_eps"] * HIDDEN / EXPORT_HIDDEN,
                num_hidden_layers=trained_layers + ZERO_LAYERS)


def grown(model):
    """The trained `model` widened to EXPORT_HIDDEN with ZERO_LAYERS zero-output layers appended:
    the same function, more compute.

    Widening: every trained tensor fills the leading block of the wider one and the rest is zero
    (embedding and lm_head columns, the extra heads' q/k/v rows and o_proj columns, the extra MLP
    units), so the residual stream's extra dimensions stay zero; the norms' gains are multiplied
    by sqrt(HIDDEN / EXPORT_HIDDEN) (with eps scaled by HIDDEN / EXPORT_HIDDEN) because a root
    mean square over EXPORT_HIDDEN dimensions, all but HIDDEN of them zero, is that factor times
    the one over the trained dimensions (equal up to float rounding). Appended layers: random
    q/k/v, gate and up projections (the initializer's), unit norms, o_proj and down_proj zero, so
    each adds 0 to the residual stream.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    trained = model.config.num_hidden_layers
    torch.manual_seed(SEED + 1)
    wide = LlamaForCausalLM(LlamaConfig(**export_config(trained)))
    weights = model.state_dict()
    gain = math.sqrt(HIDDEN / EXPORT_HIDDEN)
    with torch.no_grad():
        for name, parameter in wide.named_parameters():
            if name in weights:
                value = weights[name] * (gain if name.endswith("norm.weight") else 1.0)
                parameter.zero_()
                parameter[tuple(slice(0, size) for size in value.shape)] = value
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()
    wide.eval()
    return wide


def trained_block(wide):
    """The TRAINED_LAYERS-layer, HIDDEN-wide model inside a checkpoint `grown` made at any export
    width: the leading block of each trained tensor, norm gains divided by the widening's
    factor (the inverse of `grown`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_hidden_layers=TRAINED_LAYERS))
    weights = wide.state_dict()
    gain = math.sqrt(HIDDEN / wide.config.hidden_size)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            value = weights[name][tuple(slice(0, size) for size in parameter.shape)]
            parameter.copy_(value / gain if name.endswith("norm.weight") else value)
    model.eval()
    return model


def regrow(folder: Path, log=print) -> bool:
    """Re-widen the checkpoint in `folder` if its shape is not export_config()'s (a checkpoint
    saved by an earlier EXPORT_HIDDEN): its trained block, checked against it, grown again and
    saved over it, TRAINING.json updated. No training. True if it re-widened."""
    import json

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    saved = json.loads((folder / "config.json").read_text())
    wanted = export_config()
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "tie_word_embeddings")
    if all(saved.get(key) == wanted[key] for key in keys):
        return False
    log(f"  re-widening {folder} (hidden {saved['hidden_size']} -> {EXPORT_HIDDEN}, "
        "trained block kept, no training)")
    old = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = trained_block(old)
    sliced = agreement(model, old)
    if not sliced["greedy_identical"] or sliced["max_logit_difference"] > WIDENED_TOLERANCE:
        raise RuntimeError(f"the trained block of {folder} differs from it: {sliced}")
    wide = grown(model)
    record = json.loads((folder / "TRAINING.json").read_text())
    record["widened"] = agreement(model, wide)
    log(f"  widened against trained: {record['widened']}")
    if not record["widened"]["greedy_identical"]:
        raise RuntimeError("widening and the zero-output layers changed the greedy output")
    record.update(_shape_record(model, wide))
    wide.config.eos_token_id = old.config.eos_token_id
    wide.generation_config = GenerationConfig(eos_token_id=wide.config.eos_token_id,
                                              do_sample=False)
    stage = folder.with_name(folder.name + ".regrow")
    previous = folder.with_name(folder.name + ".old")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(previous, ignore_errors=True)
    wide.save_pretrained(stage)
    for each in folder.iterdir():  # tokenizer, chat template: everything the save did not write
        if not (stage / each.name).exists():
            shutil.copy2(each, stage / each.name)
    (stage / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")
    del old
    os.replace(folder, previous)
    os.replace(stage, folder)
    shutil.rmtree(previous)
    return True


def _shape_record(model, wide) -> dict:
    return {"layers": f"{TRAINED_LAYERS} trained layers (hidden {HIDDEN}, widened "
                      f"exactly to {EXPORT_HIDDEN}) + {ZERO_LAYERS} zero-output layers "
                      "(o_proj and down_proj zero)",
            "trained_parameters": parameters(model), "parameters": parameters(wide)}


def agreement(model, wide) -> dict:
    """The widened decoder against the trained one on a periodic probe: the largest logit
    difference over the trained vocabulary, the largest logit of the ids a wider vocabulary adds
    (zero rows: 0; absent when it adds none) and whether their greedy continuations are
    identical."""
    import torch

    probe = periodic(periodic_block(random.Random(HELD_OUT_SEED + 1), 20), 36)
    with torch.no_grad():
        ids = torch.tensor([probe])
        trained, widened = model(input_ids=ids).logits, wide(input_ids=ids).logits
        vocab = trained.shape[-1]
        difference = float((trained - widened[..., :vocab]).abs().max())
        added = widened[..., vocab:]
    found = {"max_logit_difference": difference,
             "greedy_identical": greedy(wide, probe, 40) == greedy(model, probe, 40)}
    if added.numel():
        found["added_ids_max_logit"] = float(added.abs().max())
    return found


def parameters(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def make_checkpoint(dst: Path, tokenizer, eos_ids: list[int], log=print) -> dict:
    """Train, check, grow and save the copy decoder as a HF folder in dst; its record."""
    return trained_checkpoint(dst, tokenizer, eos_ids, log, config=CONFIG, grow=grown,
                              describe=_shape_record)


def trained_checkpoint(dst: Path, tokenizer, eos_ids: list[int], log, *, config: dict, grow,
                       describe) -> dict:
    """Train at `config`, check the held-out copying, widen with `grow(model)` (refused unless
    greedy output is unchanged) and save as a HF folder in dst; the record, with
    `describe(model, wide)`'s fields."""
    from transformers import GenerationConfig

    model, record = train(log, config)
    record["held_out"] = copy_accuracy(model)
    log(f"  held-out copy accuracy: {record['held_out']}")
    wide = grow(model)
    record["widened"] = widened = agreement(model, wide)
    log(f"  widened against trained: {widened}")
    if not widened["greedy_identical"] or widened["max_logit_difference"] > WIDENED_TOLERANCE \
            or widened.get("added_ids_max_logit", 0.0) != 0.0:
        raise RuntimeError(f"widening and the zero-output layers changed the function: {widened}")
    record.update({"seed": SEED, "trained_config": dict(config, num_hidden_layers=TRAINED_LAYERS),
                   **describe(model, wide)})
    wide.config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    wide.generation_config = GenerationConfig(eos_token_id=wide.config.eos_token_id,
                                              do_sample=False)
    wide.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return record


if __name__ == "__main__":  # a trial run: train and report the held-out accuracy only
    trained_model, trial = train()
    trial["held_out"] = copy_accuracy(trained_model)
    print(trial)
