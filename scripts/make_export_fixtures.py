"""Regenerate tests/fixtures/exports/: tiny decoders written by the real exporters.

Every fixture is a random-weight decoder (hidden 64, GQA 4/2 heads, a byte-level BPE tokenizer
trained here) exported by onnxruntime-genai's model builder, Hugging Face Optimum or
torch.onnx (dynamo), kept as the exporter wrote it. Nothing is downloaded: configs come from
``AutoConfig.for_model``, weights from a fixed torch seed. Running the script twice writes
byte-identical files; MANIFEST.json lists every file with its sha256.

The exporters live in two scratch venvs, never in the package's dependencies (onnxruntime and
onnxruntime-gpu must not share a venv): `exporters` and `exporters-optimum` of
scripts/_bench/venvs.py, pinned, made under the user's cache the first time they are needed
(said on stderr)::

    .venv/bin/python scripts/make_export_fixtures.py --out tests/fixtures/exports

The driver (any Python) runs each step in a child process of the venv that owns the exporter
(the genai venv also runs torch.onnx and the checks); ``--genai-python`` and
``--optimum-python`` name other interpreters.

``--only NAME`` (repeatable) regenerates some fixtures and keeps the others' manifest entries;
``--check-only`` runs the load-and-forward checks on an existing corpus; their greedy tokens
come from onnxruntime-genai for a genai-layout export and from a bare ONNX Runtime loop for the
others, never from onnx_chunk, whose tests the corpus serves. docs/exports.md describes the
layouts and how to add an export.
"""

from __future__ import annotations

import os

# Deterministic tokenizer training and torch kernels: fix the thread pools before the imports.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import venvs as scratch

SEED = 1234
VOCAB_SIZE = 384
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 96
LAYERS = 2
MAX_POSITIONS = 2048
SLIDING_WINDOW = 32
# A window as wide as a real model's (gemma2's 4096) over a context of the same length: the
# cache of its sliding layer must hold 4096 positions whatever capacity a runtime picks.
WIDE_WINDOW = 4096
INIT_RANGE = 0.15
SIZE_LIMIT = 8 * 1024 * 1024
CHECK_PROMPT = [1, 40, 41, 42, 43, 44]  # <s> and five byte tokens

SPECIAL_TOKENS = [
    "<pad>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
PAD, BOS, EOS, IM_START, IM_END, HEADER_START, HEADER_END, EOT = range(len(SPECIAL_TOKENS))

# Training text for the tokenizer: multi-byte UTF-8 (accents, CJK, emoji) so that byte-level
# merges split characters across tokens, and the chat markers spelled out.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A chunked prefill splits a long prompt into pieces.
Once upon a time, a small model learned to count: one, two, three, four, five, six, seven.
def forward(self, input_ids, attention_mask): return self.lm_head(self.model(input_ids))
for i in range(10): print(i * i, end=" ")  # squares 0 1 4 9 16 25 36 49 64 81
Le café est très chaud ; l'élève a déjà mangé une crème brûlée à Noël. Ça va très bien, merci.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus Köln und Düsseldorf.
El niño pidió una piña y un jalapeño en la mañana. ¿Dónde está la estación? ¡Olé!
São Paulo, Kraków, Reykjavík, Zürich, Malmö, Tromsø, Łódź, İstanbul, Cluj-Napoca.
机器学习模型在长文本上进行分块预填充。今天天气很好，我们去公园散步吧。
日本語のテキストも少し入れておきます。東京は大きな都市です。ありがとうございます。
한국어 문장도 있습니다. 안녕하세요, 만나서 반갑습니다.
Emoji too: 🙂 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 👩‍💻 🐍 ✨ and math symbols ∑ ∫ √ ≈ ≠ ≤ ≥ → ∞ π.
Numbers: 3.14159 2.71828 1234567890 0x7fff 1e-5 -42 +17 100% 50/50.
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
Paris.<|im_end|>
<|start_header_id|>user<|end_header_id|>

Write a haiku about memory.<|eot_id|><|start_header_id|>assistant<|end_header_id|>

Keys and values stay, a cache that grows with each word, rewound when it must.<|eot_id|>
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One small Hugging Face model: its config, tokenizer settings and chat template."""

    model_type: str
    config: dict[str, Any]
    eos: int | tuple[int, ...] = EOS
    chat_template: str | None = None

    def eos_ids(self) -> list[int]:
        return list(self.eos) if isinstance(self.eos, tuple) else [self.eos]


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": INIT_RANGE,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
}

# What gemma2 and gemma3 share: one sliding-window layer, then one full-attention layer.
_GEMMA = dict(
    _COMMON,
    head_dim=HEAD_DIM,
    query_pre_attn_scalar=HEAD_DIM,
    sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
)

FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        dict(_COMMON, tie_word_embeddings=False),
        eos=(EOS, EOT),
        chat_template=LLAMA3_TEMPLATE,
    ),
    "llama-tied": Family("llama", dict(_COMMON, tie_word_embeddings=True)),
    "qwen2": Family(
        "qwen2",
        dict(_COMMON, tie_word_embeddings=False),
        eos=IM_END,
        chat_template=CHATML_TEMPLATE,
    ),
    "qwen3": Family(
        "qwen3",
        dict(_COMMON, head_dim=HEAD_DIM, tie_word_embeddings=False),
        eos=IM_END,
        chat_template=CHATML_TEMPLATE,
    ),
    "phi3": Family(
        "phi3",
        dict(
            _COMMON,
            original_max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
    ),
    "gemma2": Family(
        "gemma2",
        # Tied, gemma's sqrt(hidden) embedding scale makes random weights echo the last token.
        dict(_GEMMA, tie_word_embeddings=False),
        eos=(EOS, EOT),
        chat_template=LLAMA3_TEMPLATE,
    ),
    "gemma2-w4096": Family(
        "gemma2",
        dict(
            _GEMMA,
            tie_word_embeddings=False,
            sliding_window=WIDE_WINDOW,
            max_position_embeddings=WIDE_WINDOW,
        ),
        eos=(EOS, EOT),
        chat_template=LLAMA3_TEMPLATE,
    ),
    # transformers 5 nests gemma3's rope settings per layer type, which builder 0.18 cannot read
    # (KeyError 'rope_type'); the attempt stays in FIXTURES so the manifest records it.
    "gemma3": Family(
        "gemma3_text",
        dict(_GEMMA, tie_word_embeddings=True),
        eos=(EOS, EOT),
        chat_template=LLAMA3_TEMPLATE,
    ),
    "lfm2": Family(
        "lfm2",
        dict(
            _COMMON,
            layer_types=["conv", "full_attention"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=True,
        ),
        eos=IM_END,
        chat_template=CHATML_TEMPLATE,
    ),
}


STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"
TORCH_NOTE = f"node metadata '{STACK_TRACE_KEY}' removed (absolute paths of the exporting checkout)"


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One export in the corpus: which family, which exporter, which precision."""

    name: str
    family: str
    layout: str  # genai | optimum | torch_onnx
    precision: str
    note: str = ""
    # The builder's --extra_options (genai layout only).
    extra_options: tuple[str, ...] = ()


FIXTURES: list[Fixture] = [
    *[
        Fixture(f"genai-{family}-{precision}", family, "genai", precision)
        for family in ("llama", "qwen3", "phi3", "gemma2", "lfm2")
        for precision in ("fp32", "int4")
    ],
    Fixture("genai-llama-int4h8", "llama", "genai", "int4",
            note="the builder's INT4 export with an 8-bit lm_head "
            "(matmul_mixed_precision=last_matmul:int8)",
            extra_options=("matmul_mixed_precision=last_matmul:int8",)),
    Fixture("genai-gemma2-w4096-fp32", "gemma2-w4096", "genai", "fp32"),
    Fixture("genai-gemma3-fp32", "gemma3", "genai", "fp32"),
    Fixture(
        "genai-llama-fp16",
        "llama",
        "genai",
        "fp16",
        note="for CPU the builder writes fp16 I/O, position_ids and MultiHeadAttention with "
        "repeat_kv instead of GroupQueryAttention, and past_present_share_buffer false; "
        "onnxruntime runs a forward, but onnxruntime-genai 0.18 fails on the first decode step "
        "(ORT 1.32 CPU: "
        "'Shape mismatch attempting to re-use buffer' in an inserted fp16 Cast)",
    ),
    Fixture("optimum-llama-fp32", "llama", "optimum", "fp32"),
    Fixture("optimum-qwen2-fp32", "qwen2", "optimum", "fp32"),
    Fixture("optimum-llama-tied-fp32", "llama-tied", "optimum", "fp32"),
    Fixture("torch-llama-opset23", "llama", "torch_onnx", "fp32", note=TORCH_NOTE),
]


# Which venv runs each layout's exporter, and the scratch venv each is by default.
VENV_SPECS = {"genai": scratch.EXPORTERS, "optimum": scratch.EXPORTERS_OPTIMUM}
LAYOUT_VENV = {"genai": "genai", "optimum": "optimum", "torch_onnx": "genai"}
EXPORTER_DIST = {
    "genai": "onnxruntime-genai",
    "optimum": "optimum-onnx",
    "torch_onnx": "torch",
}
# Source files that torch.onnx does not write but a runtime reads beside the model.
SOURCE_FILES_KEPT = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def _log(message: str) -> None:
    print(message, flush=True)


def exporter_versions() -> dict[str, str]:
    """Versions of the packages in this interpreter's venv that shape an export."""
    dists = [
        "torch",
        "transformers",
        "onnxruntime-genai",
        "optimum-onnx",
        "optimum",
        "onnxruntime",
    ]
    dists += ["onnx", "onnxscript", "onnx-ir", "tokenizers"]
    found = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def train_tokenizer(family: Family):
    """A byte-level BPE with exactly VOCAB_SIZE entries, wrapped as a transformers tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(
            f"tokenizer has {tokenizer.get_vocab_size()} entries, expected {VOCAB_SIZE}"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[BOS],
        eos_token=SPECIAL_TOKENS[family.eos_ids()[0]],
        pad_token=SPECIAL_TOKENS[PAD],
        additional_special_tokens=SPECIAL_TOKENS[IM_START:],
        model_max_length=family.config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    if family.chat_template is not None:
        fast.chat_template = family.chat_template
    return fast


def make_source(family_name: str, dst: Path) -> None:
    """Save a random-weight Hugging Face checkpoint (config, safetensors, tokenizer) in dst."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    family = FAMILIES[family_name]
    eos = family.eos_ids()
    config = AutoConfig.for_model(
        family.model_type, **family.config, eos_token_id=eos if len(eos) > 1 else eos[0]
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS,
        eos_token_id=config.eos_token_id,
        pad_token_id=PAD,
        do_sample=False,
    )
    model.save_pretrained(dst)
    train_tokenizer(family).save_pretrained(dst)


def torch_export(src: Path, dst: Path) -> None:
    """torch.onnx (dynamo) at opset 23 with past KV inputs and present outputs."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa")
    model.eval()
    config = model.config
    layers = config.num_hidden_layers

    class Decoder(torch.nn.Module):
        """Flat tensors in and out: past KV per layer in, logits and present KV out."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    batch, seq, past_len = 2, 3, 5
    past = [
        torch.zeros(batch, config.num_key_value_heads, past_len, HEAD_DIM)
        for _ in range(2 * layers)
    ]
    args = (
        torch.ones(batch, seq, dtype=torch.int64),
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq, dtype=torch.int64).expand(batch, seq),
        *past,
    )
    dim = torch.export.Dim
    b, s, p, t = (
        dim("batch_size"),
        dim("sequence_length"),
        dim("past_sequence_length"),
        dim("total_sequence_length"),
    )
    dynamic = (
        {0: b, 1: s},
        {0: b, 1: t},
        {0: b, 1: s},
        tuple([{0: b, 2: p}] * (2 * layers)),
    )
    input_names = ["input_ids", "attention_mask", "position_ids"]
    output_names = ["logits"]
    for i in range(layers):
        input_names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        output_names += [f"present.{i}.key", f"present.{i}.value"]
    with torch.no_grad():
        program = torch.onnx.export(
            Decoder(model).eval(),
            args,
            dynamo=True,
            opset_version=23,
            dynamic_shapes=dynamic,
            input_names=input_names,
            output_names=output_names,
            optimize=True,
        )
    dst.mkdir(parents=True, exist_ok=True)
    program.save(str(dst / "model.onnx"), external_data=True)
    _strip_stack_traces(dst / "model.onnx")
    for name in SOURCE_FILES_KEPT:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)


def _strip_stack_traces(path: Path) -> None:
    """Drop the per-node Python stack traces: they hold this checkout's absolute paths."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        kept = [prop for prop in node.metadata_props if prop.key != STACK_TRACE_KEY]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    onnx.save(model, str(path))


def check_fixture(folder: Path, layout: str) -> dict[str, Any]:
    """One forward of the check prompt in onnxruntime (CPU), then 8 greedy tokens."""
    import numpy as np
    import onnxruntime as ort

    result: dict[str, Any] = {}
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    head, window = HEAD_DIM, SLIDING_WINDOW
    if (folder / "genai_config.json").exists():
        decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
        head = decoder["head_size"]
        window = decoder.get("sliding_window", {}).get("window_size", SLIDING_WINDOW)
    rows = len(CHECK_PROMPT)
    sizes = {
        "batch_size": 1,
        "batch": 1,
        "sequence_length": rows,
        "past_sequence_length": 0,
        "past_sliding_length": window,
        "total_sequence_length": rows,
        "kv_cache_dim": head,
        "past_sequence_length + sequence_length": rows,
        "past_sequence_length + 1": rows,
    }
    types = {
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
    }
    feeds = {}
    for port in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in port.shape]
        dtype = types[port.type]
        if port.name == "input_ids":
            feeds[port.name] = np.array([CHECK_PROMPT], dtype=dtype)
        elif port.name == "position_ids":
            feeds[port.name] = np.arange(rows, dtype=dtype)[None]
        elif port.name == "attention_mask":
            feeds[port.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[port.name] = np.zeros(shape, dtype=dtype)
    outputs = session.run(None, feeds)
    logits = outputs[0]
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{folder.name}: logits not finite")
    result["forward"] = f"logits {list(logits.shape)}, {len(outputs) - 1} present"
    if layout != "genai":
        result["ort_tokens"] = _ort_greedy(session, outputs, feeds)
    if layout == "genai":
        try:
            result["genai_tokens"] = _genai_greedy(folder)
        except RuntimeError as error:  # the table shows it; the manifest notes say why
            result["genai_error"] = str(error).splitlines()[0][:160]
    return result


def _ort_greedy(session, outputs: list, feeds: dict, steps: int = 8) -> list[int]:
    """Greedy decode steps after the first forward, feeding each present back as past."""
    import numpy as np

    names = [port.name for port in session.get_outputs()]
    tokens = []
    for _ in range(steps):
        tokens.append(int(outputs[0][0, -1].argmax()))
        total = feeds["attention_mask"].shape[1] + 1
        feeds = {
            "input_ids": np.array([[tokens[-1]]], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.array([[total - 1]], dtype=np.int64),
        } | {
            name.replace("present.", "past_key_values."): value
            for name, value in zip(names[1:], outputs[1:])
        }
        outputs = session.run(None, feeds)
    return tokens


def _genai_greedy(folder: Path) -> list[int]:
    """8 greedy tokens from onnxruntime_genai.Model(folder), after a tokenizer round trip."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    text = "Le café 🙂 机器 déjà 👩‍💻"  # genai's decode drops special tokens: none here
    if tokenizer.decode(tokenizer.encode(text)) != text:
        raise RuntimeError(f"{folder.name}: the genai tokenizer does not round-trip {text!r}")
    prompt = CHECK_PROMPT
    params = og.GeneratorParams(model)
    # max_length sets genai's KV capacity, which a sliding-window cache needs >= the window.
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    window = config["decoder"].get("sliding_window", {}).get("window_size", SLIDING_WINDOW)
    params.set_search_options(max_length=min(2 * window, config["context_length"]),
                              do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    for _ in range(8):
        if generator.is_done():
            break
        generator.generate_next_token()
    return [int(token) for token in generator.get_sequence(0)][len(prompt) :]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def features(fixture: Fixture) -> dict[str, Any]:
    family = FAMILIES[fixture.family]
    cfg = family.config
    eos = family.eos_ids()
    return {
        "sliding_window": cfg.get("sliding_window"),
        "conv_state": "conv" in cfg.get("layer_types", []),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings")),
        "chat_template": family.chat_template is not None,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "eos_list": len(eos) > 1,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": cfg["max_position_embeddings"],
    }


def file_entries(folder: Path) -> list[dict[str, Any]]:
    return [
        {
            "path": path.relative_to(folder).as_posix(),
            "bytes": path.stat().st_size,
            "sha256": _sha256(path),
        }
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    ]


class Driver:
    """Runs each step in a child of the venv that owns it, staging exports in a temp folder."""

    def __init__(self, out: Path, work: Path, pythons: dict[str, Path], venvs: set[str]):
        """`venvs`: the venvs this run uses (their versions are read; the others need not
        exist)."""
        self.out = out
        self.work = work
        self.pythons = pythons
        self.versions = {venv: json.loads(self._child(venv, "--versions")) for venv in venvs}

    def _child(self, venv: str, *args: str) -> str:
        return self._run([str(self.pythons[venv]), str(Path(__file__).resolve()), *args])

    def _run(self, cmd: list[str]) -> str:
        result = subprocess.run(cmd, check=False, cwd=self.work, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr).strip().splitlines()[-12:]
            raise RuntimeError(
                f"`{' '.join(cmd[:4])} ...` exited {result.returncode}:\n" + "\n".join(tail)
            )
        return result.stdout

    def source(self, venv: str, family: str) -> Path:
        src = self.work / "src" / venv / family
        if not src.exists():
            self._child(venv, "--make-source", family, str(src))
        return src

    def export(self, fixture: Fixture, dst: Path) -> None:
        venv = LAYOUT_VENV[fixture.layout]
        src = self.source(venv, fixture.family)
        python = str(self.pythons[venv])
        if fixture.layout == "genai":
            self._run(
                [
                    python,
                    "-m",
                    "onnxruntime_genai.models.builder",
                    "-m",
                    str(src),
                    "-i",
                    str(src),
                    "-o",
                    str(dst),
                    "-p",
                    fixture.precision,
                    "-e",
                    "cpu",
                    "-c",
                    str(self.work / "cache"),
                    *(("--extra_options", *fixture.extra_options)
                      if fixture.extra_options else ()),
                ]
            )
        elif fixture.layout == "optimum":
            self._run(
                [
                    python,
                    "-m",
                    "optimum.commands.optimum_cli",
                    "export",
                    "onnx",
                    "--task",
                    "text-generation-with-past",
                    "--model",
                    str(src),
                    str(dst),
                ]
            )
        else:
            self._child(venv, "--torch-export", str(src), str(dst))

    def build(self, fixture: Fixture) -> dict[str, Any]:
        started = time.monotonic()
        stage = self.work / "stage" / fixture.name
        self.export(fixture, stage)
        notes = [fixture.note] if fixture.note else []
        final = self.out / fixture.name
        if final.exists():
            shutil.rmtree(final)
        shutil.move(str(stage), str(final))
        _log(f"  built in {time.monotonic() - started:.1f}s")
        venv = LAYOUT_VENV[fixture.layout]
        return {
            "name": fixture.name,
            "exporter": EXPORTER_DIST[fixture.layout],
            "exporter_version": self.versions[venv][EXPORTER_DIST[fixture.layout]],
            "model_type": FAMILIES[fixture.family].model_type,
            "precision": fixture.precision,
            "layout": fixture.layout,
            "venv": venv,
            "features": features(fixture),
            "notes": notes,
            "files": file_entries(final),
        }

    def check(self, name: str, layout: str) -> dict[str, Any]:
        return json.loads(self._child("genai", "--check", str(self.out / name), layout))


def _print_checks(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(name) for name, _, _ in rows)
    for name, forward, tokens in rows:
        _log(f"  {name:<{width}}  {forward:<34}  {tokens}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/exports"))
    parser.add_argument("--only", action="append", default=[], help="fixture name (repeatable)")
    parser.add_argument("--check-only", action="store_true", help="check the corpus, build nothing")
    parser.add_argument("--genai-python", type=Path, default=None,
                        help="interpreter with the genai builder and torch (default: the "
                             "`exporters` scratch venv, made on first use)")
    parser.add_argument("--optimum-python", type=Path, default=None,
                        help="interpreter with optimum-onnx (default: the `exporters-optimum` "
                             "scratch venv, made on first use)")
    parser.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--make-source", nargs=2, metavar=("FAMILY", "DST"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--torch-export",
        nargs=2,
        type=Path,
        metavar=("SRC", "DST"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--check", nargs=2, metavar=("FOLDER", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.versions:
        print(json.dumps(exporter_versions()))
        return 0
    if args.make_source:
        make_source(args.make_source[0], Path(args.make_source[1]))
        return 0
    if args.torch_export:
        torch_export(*args.torch_export)
        return 0
    if args.check:
        print(json.dumps(check_fixture(Path(args.check[0]), args.check[1])))
        return 0

    started = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "MANIFEST.json"
    previous = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    entries = {entry["name"]: entry for entry in previous.get("fixtures", [])}
    failures = {entry["name"]: entry for entry in previous.get("failures", [])}
    chosen = [f for f in FIXTURES if not args.only or f.name in args.only]
    # The checks run in the genai venv; only the exporters of the chosen fixtures run.
    used = {"genai"} | (set() if args.check_only else {LAYOUT_VENV[f.layout] for f in chosen})
    given = {"genai": args.genai_python, "optimum": args.optimum_python}
    pythons = {venv: given[venv] or scratch.python(VENV_SPECS[venv]) for venv in sorted(used)}
    with tempfile.TemporaryDirectory(prefix="export-fixtures-") as tmp:
        driver = Driver(out, Path(tmp), pythons, used)
        if not args.check_only:
            for fixture in chosen:
                _log(fixture.name)
                try:
                    entries[fixture.name] = driver.build(fixture)
                    failures.pop(fixture.name, None)
                except RuntimeError as error:
                    _log(f"  FAILED: {error}")
                    entries.pop(fixture.name, None)
                    shutil.rmtree(out / fixture.name, ignore_errors=True)
                    reason = str(error).strip().splitlines()[-1].replace(tmp, "<tmp>")
                    failures[fixture.name] = {
                        "name": fixture.name,
                        "exporter": EXPORTER_DIST[fixture.layout],
                        "model_type": FAMILIES[fixture.family].model_type,
                        "precision": fixture.precision,
                        "reason": reason,
                    }
            order = [f.name for f in FIXTURES]
            manifest = {
                "generator": "scripts/make_export_fixtures.py",
                # A venv this run did not use keeps the versions its fixtures were built with.
                "versions": previous.get("versions", {}) | driver.versions,
                "fixtures": sorted(entries.values(), key=lambda e: order.index(e["name"])),
                "failures": sorted(failures.values(), key=lambda e: order.index(e["name"])),
            }
            manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        _log("checks (onnxruntime forward; 8 greedy tokens: onnxruntime-genai, else an ORT loop)")
        rows = []
        for entry in sorted(entries.values(), key=lambda e: e["name"]):
            if args.only and entry["name"] not in args.only:
                continue
            try:
                result = driver.check(entry["name"], entry["layout"])
                tokens = result.get("genai_tokens", result.get("genai_error"))
                rows.append((entry["name"], result["forward"], str(tokens or result["ort_tokens"])))
            except RuntimeError as error:
                rows.append((entry["name"], "FAILED", str(error).splitlines()[-1]))
        if rows:
            _print_checks(rows)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    _log(
        f"wall time {time.monotonic() - started:.0f}s; {out}: {total} bytes "
        f"({total / 2**20:.2f} MiB)"
    )
    if total >= SIZE_LIMIT:
        _log(f"ERROR: the corpus is over {SIZE_LIMIT} bytes")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
