"""A small Llama decoder trained on English text: the `text-fp32` benchmark model's checkpoint.

The quantized KV cache's accuracy means something only on weights whose keys and values carry
language: random-weight decoders attend almost uniformly and their greedy tokens flip on any
noise. This decoder is trained here (torch, CPU, fixed seed, TORCH_THREADS threads, at most
MAX_STEPS steps and WALL_S seconds) on the English licence texts Debian ships in
/usr/share/common-licenses (base-files): every file there except HELD_OUT_FILE, each read once
(GFDL, GPL and LGPL are symlinks to GFDL-1.3, GPL-3 and LGPL-3). HELD_OUT_FILE (Apache-2.0, a
licence with no other version in the folder) is held back whole for evaluation: neither the
tokenizer nor the model sees it, and scripts/bench_kv_accuracy.py measures perplexity and
greedy agreement on it.

Tokenizer: a byte-level BPE of VOCAB_SIZE entries (the `tokenizers` library) trained on the
training text only, so any text encodes; saved as tokenizer.json with the checkpoint, and the
genai builder copies it into the export. Model: LAYERS Llama layers, hidden HIDDEN, HEADS query
heads and KV_HEADS KV heads (so the export's GroupQueryAttention groups queries) of HEAD_DIM,
tied embeddings. Training: random windows of TRAIN_LENGTH + 1 tokens from the training token
stream (each file's tokens followed by </s>), AdamW, a warmup then a cosine to FINAL_RATE of the
peak rate over the run's progress, where progress is the larger of steps / MAX_STEPS and elapsed
/ WALL_S (so a slow machine still ends the schedule; TRAINING.json records the steps reached).
`perplexity` scores the held-back text in non-overlapping windows of EVAL_WINDOW tokens, each
teacher-forced from its own start (every token but a window's first is scored), the same
windows the benchmark script scores through the runtime.

Run by scripts/make_bench_models.py under the exporters venv (torch, transformers, tokenizers);
standard library at import time, so the benchmark scripts can read its constants.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from .copy_decoder import greedy

SEED = 1234
LICENSES = Path("/usr/share/common-licenses")
HELD_OUT_FILE = "Apache-2.0"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
PAD, BOS, EOS = range(len(SPECIAL_TOKENS))
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 768
TRAIN_LENGTH = 256
BATCH = 4
MAX_STEPS = 3000
WALL_S = 1080.0  # 18 minutes of training at most
TORCH_THREADS = 2
LEARNING_RATE = 2e-3
WARMUP = 60
FINAL_RATE = 0.05
EVAL_WINDOW = 256

CONFIG = {
    "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "max_position_embeddings": 8192, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "initializer_range": 0.02,
    "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
}


class LicensesMissing(FileNotFoundError):
    """The licence folder the training text comes from is not there."""


def texts(folder: Path | None = None) -> tuple[dict[str, str], str]:
    """({name: text} of the training files, the held-back text) of `folder` (default
    LICENSES): every file once, under the first of its names in sorted order (GPL, a symlink
    to GPL-3, is read as GPL and GPL-3 is skipped), none that is or links to HELD_OUT_FILE.
    LicensesMissing when the folder or its HELD_OUT_FILE is not there."""
    folder = LICENSES if folder is None else folder
    if not (folder / HELD_OUT_FILE).is_file():
        raise LicensesMissing(f"{folder / HELD_OUT_FILE} is missing: the text-fp32 model trains "
                              f"on the licence texts Debian's base-files installs in {folder}")
    seen, train = {(folder / HELD_OUT_FILE).resolve()}, {}
    for path in sorted(folder.iterdir()):
        real = path.resolve()
        if not real.is_file() or real in seen:
            continue
        seen.add(real)
        train[path.name] = real.read_text(encoding="utf-8")
    return train, (folder / HELD_OUT_FILE).read_text(encoding="utf-8")


def training_lines(folder: Path | None = None) -> list[str]:
    """The training text's non-blank lines (calibration prompts that are not held-back text)."""
    train, _ = texts(folder)
    return [line.strip() for text in train.values() for line in text.splitlines()
            if line.strip()]


def held_out_text(folder: Path | None = None) -> str:
    return texts(folder)[1]


def train_tokenizer(train: dict[str, str]):
    """A byte-level BPE with VOCAB_SIZE entries trained on the training text, wrapped as a
    transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([line for text in train.values()
                                   for line in text.splitlines(keepends=True)], trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} entries, expected "
                           f"{VOCAB_SIZE}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL_TOKENS[BOS],
                                   eos_token=SPECIAL_TOKENS[EOS], pad_token=SPECIAL_TOKENS[PAD],
                                   model_max_length=CONFIG["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def windows(ids: list[int], window: int = EVAL_WINDOW) -> list[list[int]]:
    """`ids` cut into non-overlapping windows of `window` tokens (a last shorter one kept when it
    has at least 2 tokens)."""
    cut = [ids[start:start + window] for start in range(0, len(ids), window)]
    return [each for each in cut if len(each) >= 2]


def perplexity(model, ids: list[int], window: int = EVAL_WINDOW) -> dict:
    """exp(mean negative log-likelihood) of `ids` in windows, each scored from its own start."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for each in windows(ids, window):
            tensor = torch.tensor([each])
            logits = model(input_ids=tensor).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, tensor[0, 1:],
                                                             reduction="sum"))
            count += len(each) - 1
    return {"tokens_scored": count, "window": window, "nll": total / count,
            "perplexity": math.exp(total / count)}


def train(stream: list[int], log=print):
    """The trained LlamaForCausalLM and a record of its training (loss curve included)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    data = torch.tensor(stream, dtype=torch.long)
    began = time.monotonic()
    curve, recent, step = [], [], 0
    model.train()
    while True:
        progress = max(step / MAX_STEPS, (time.monotonic() - began) / WALL_S)
        if progress >= 1.0:
            break
        if step < WARMUP:
            scale = (step + 1) / WARMUP
        else:
            scale = FINAL_RATE + (1 - FINAL_RATE) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * scale
        starts = [rng.randrange(len(stream) - TRAIN_LENGTH - 1) for _ in range(BATCH)]
        batch = torch.stack([data[start:start + TRAIN_LENGTH + 1] for start in starts])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent.append(loss.item())
        step += 1
        if step % 25 == 0:
            elapsed = time.monotonic() - began
            curve.append({"step": step, "loss": round(sum(recent) / len(recent), 4),
                          "s": round(elapsed, 1), "lr": round(LEARNING_RATE * scale, 6)})
            recent = []
            if step % 100 == 0:
                log(f"  step {step}: loss {curve[-1]['loss']:.4f} ({elapsed:.0f} s)")
    model.eval()
    last = [point["loss"] for point in curve[-4:]] or recent
    return model, {"steps": step, "max_steps": MAX_STEPS, "wall_budget_s": WALL_S,
                   "stopped_by": "steps" if step >= MAX_STEPS else "wall clock",
                   "batch": BATCH, "train_length": TRAIN_LENGTH,
                   "tokens_seen": step * BATCH * TRAIN_LENGTH, "learning_rate": LEARNING_RATE,
                   "warmup": WARMUP, "final_rate": FINAL_RATE, "weight_decay": 0.1,
                   "torch_threads": TORCH_THREADS, "final_loss": round(sum(last) / len(last), 4),
                   "train_s": round(time.monotonic() - began, 1), "loss_curve": curve}


def make_checkpoint(dst: Path, log=print) -> dict:
    """Train and save the text decoder with its tokenizer as a HF folder in dst; its record."""
    import torch
    from transformers import GenerationConfig

    train_texts, held = texts()
    tokenizer = train_tokenizer(train_texts)
    stream: list[int] = []
    for text in train_texts.values():
        stream += encode(tokenizer, text) + [EOS]
    held_ids = encode(tokenizer, held)
    log(f"  {len(train_texts)} training files, {sum(map(len, train_texts.values()))} characters, "
        f"{len(stream)} tokens; held back {HELD_OUT_FILE}: {len(held_ids)} tokens")
    model, record = train(stream, log)
    record["held_out"] = perplexity(model, held_ids)
    record["train_sample"] = perplexity(model, stream[:len(held_ids)])
    log(f"  held-out perplexity {record['held_out']['perplexity']:.3f}; first training tokens "
        f"{record['train_sample']['perplexity']:.3f}")
    sample = greedy(model, held_ids[:32], 48)
    record.update({
        "seed": SEED, "trained_config": dict(CONFIG),
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "text": {"folder": str(LICENSES), "train_files": sorted(train_texts),
                 "train_characters": sum(map(len, train_texts.values())),
                 "train_tokens": len(stream), "held_out_file": HELD_OUT_FILE,
                 "held_out_characters": len(held), "held_out_tokens": len(held_ids),
                 "held_out_rule": f"{HELD_OUT_FILE} held back whole (tokenizer and model never "
                                  "see it)"},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": VOCAB_SIZE,
                      "trained_on": "the training files only"},
        "greedy_sample": {"prompt": tokenizer.decode(held_ids[:32]),
                          "continuation": tokenizer.decode(sample)},
        "torch": torch.__version__,
    })
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS,
                                               pad_token_id=PAD, do_sample=False)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return record
