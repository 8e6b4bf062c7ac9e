"""Build the real-size benchmark models: builder exports and GGUF files with real models' shapes.

Two shapes, random weights from a fixed torch seed, nothing downloaded (the configs are written
here, the tokenizer is the byte-level BPE the export fixtures train):

* ``qwen05``: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads, intermediate
  4864, vocab 151936, tied embeddings, q/k/v biases);
* ``llama1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV heads, intermediate
  8192, vocab 128256, tied embeddings, llama3 rope scaling).

Names are ``SHAPE-PRECISION``: ``qwen05-int4``, ``qwen05-fp32``, ``llama1b-int4`` and
``llama1b-fp32`` are onnxruntime-genai model-builder exports for the CPU (INT4 is MatMulNBits
with block 32), with ``search.max_length`` set to MAX_LENGTH so genai's preallocated KV cache
matches what a benchmark asks for rather than the model's full context; ``qwen05-q4_0``,
``qwen05-q8_0``, ``llama1b-q4_0`` and ``llama1b-q8_0`` are GGUF files of the same checkpoint,
written by the converter shipped in llama.cpp's sources (Q8_0 directly, Q4_0 by llama.cpp's own
quantizer from an f16 GGUF).

``copy-fp32`` is not random: a small Llama trained here (torch, CPU, fixed seed, minutes) to
continue periodic sequences, the workload where prompt-lookup drafts are kept
(scripts/bench_speculative.py --hit-model copy-fp32); its 2 trained layers are widened exactly
and followed by 10 zero-output layers so a forward costs what a ~64M-parameter decoder costs
(scripts/_bench/copy_decoder.py says how). Its checkpoint's TRAINING.json, copied into BUILD.json,
records the training and the copy accuracy on held-out sequences. ``copyq05-int4`` is the same
recipe trained with 2 heads of 64 and widened exactly to the qwen05 shape (24 layers, 494M
parameters; scripts/_bench/copy_decoder_qwen05.py), then exported INT4: prompt lookup at real
size (scripts/bench_speculative.py --hit-model copyq05-int4).

``text-fp32`` is trained too: a 4-layer Llama (hidden 256, 4 query / 2 KV heads of 64) with its
own byte-level BPE (2048 entries), trained here on the English licence texts Debian ships in
/usr/share/common-licenses with Apache-2.0 held back whole (scripts/_bench/text_decoder.py);
its TRAINING.json (loss curve, held-out perplexity) is copied into BUILD.json, and
scripts/bench_kv_accuracy.py measures the quantized KV cache's accuracy on it; ``text-int4`` is
the builder's INT4 export of the same checkpoint (scripts/bench_int4_accuracy.py re-blocks it),
``text-int4f`` the same with a float32 lm_head and embedding, ``text-int4h8`` with an 8-bit
lm_head (the builder's answer to llama.cpp's higher-precision output tensor), ``text-f32`` and
``text-q4_0`` its GGUF files (llama.cpp's float32 and Q4_0, whose output tensor is Q6_K),
``text-q4_0h4`` a Q4_0 file with the output tensor at Q4_0 too (the 4 bits the INT4 export's
lm_head has).

Everything lands in a cache outside git: ``--root``, else $ONNX_CHUNK_BENCH_MODELS, else
~/.cache/onnx-chunk/bench-models; the benchmark scripts find a model by name there (``--model
qwen05-int4``). A built model is reused; ``--force`` rebuilds (from the checkpoint under
.sources/, which is made once: delete .sources/copy to train again).

It runs in the `exporters` scratch venv (torch, transformers, onnxruntime-genai's builder; see
scripts/_bench/venvs.py): started by an interpreter without them, it makes that venv under the
user's cache on first use and runs itself there. The GGUF names also need llama.cpp's sources
(``--llama-cpp-sdist``, default llama-cpp-python's sdist, which vendors them, downloaded into the
cache once) and llama-cpp-python for the quantizer (``--llama-cpp-python``, default the
`llamacpp` scratch venv, built on first use)::

    python scripts/make_bench_models.py qwen05-int4
    python scripts/make_bench_models.py qwen05-q4_0

Each model's folder holds BUILD.json: the shape, seed, versions, size and build time.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import venvs
from _bench.models import (
    BENCH_MODELS,
    BUILDER_PRECISION_ARGS,
    MAX_LENGTH,
    ONNX_PRECISIONS,
    SHAPES,
    TRAINED_GGUF_PRE_TOKENIZER,
    TRAINED_SHAPES,
    models_root,
    parse_name,
)

SEED = 1234
SDIST_VENDOR = "vendor/llama.cpp/"


def exporters_python() -> Path | None:
    """None when this interpreter has the exporters (torch, transformers, the genai builder);
    else the interpreter of the `exporters` scratch venv, made on first use."""
    import importlib.util

    if all(importlib.util.find_spec(name) for name in ("torch", "transformers",
                                                        "onnxruntime_genai")):
        return None
    return venvs.python(venvs.EXPORTERS)


def default_sdist(root: Path) -> Path:
    """llama-cpp-python's sdist at the `llamacpp` venv's version under root/.llama-cpp
    (downloaded once)."""
    requirement = venvs.LLAMACPP.requirements[0]
    folder = root / ".llama-cpp"
    sdist = folder / f"llama_cpp_python-{requirement.partition('==')[2]}.tar.gz"
    if not sdist.is_file():
        _log(f"downloading the sdist of {requirement} into {folder}")
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              requirement, "-d", str(folder)])
    return sdist


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(cmd: list[str], **kwargs) -> None:
    _log("  $ " + " ".join(cmd))
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
        raise SystemExit(f"`{' '.join(cmd[:4])} ...` exited {result.returncode}:\n"
                         + "\n".join(tail))


def _folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(each.stat().st_size for each in path.rglob("*") if each.is_file())


def make_source(shape: str, dst: Path) -> None:
    """A random-weight Hugging Face checkpoint of `shape` (bf16 safetensors, tokenizer) in dst.

    bf16 halves the files; every export (fp32, INT4, GGUF) starts from these same values.
    """
    import torch
    from make_export_fixtures import FAMILIES, train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = SHAPES[shape]
    family = FAMILIES[spec.tokenizer_family]
    eos = family.eos_ids()
    config = AutoConfig.for_model(spec.model_type, **spec.config,
                                  eos_token_id=eos if len(eos) > 1 else eos[0])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id,
                                               do_sample=False)
    stage = dst.with_name(dst.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    model.save_pretrained(stage)
    train_tokenizer(family).save_pretrained(stage)
    os.replace(stage, dst)


def make_trained_source(shape: str, dst: Path) -> None:
    """The trained checkpoint of `shape` (fp32 safetensors, the llama fixtures' tokenizer) in
    dst, with TRAINING.json: how it was trained and how well it does its task on held-out
    sequences."""
    import importlib

    trainer = importlib.import_module(f"_bench.{TRAINED_SHAPES[shape][1]}")
    if shape == "text":  # checked before anything is made
        try:
            trainer.texts()
        except trainer.LicensesMissing as error:
            _log(f"error: {error}")
            raise SystemExit(2) from None
    stage = dst.with_name(dst.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    if shape == "text":  # its own tokenizer, trained on its own text
        record = trainer.make_checkpoint(stage, _log)
    else:
        from make_export_fixtures import FAMILIES, train_tokenizer

        family = FAMILIES["llama"]
        record = trainer.make_checkpoint(stage, train_tokenizer(family), family.eos_ids(), _log)
    (stage / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")
    os.replace(stage, dst)


def source(root: Path, shape: str) -> Path:
    """The shape's checkpoint under root/.sources (made once)."""
    folder = root / ".sources" / shape
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        if shape in TRAINED_SHAPES:
            _log(f"training the {shape} checkpoint in {folder}")
            make_trained_source(shape, folder)
        else:
            _log(f"making the random-weight {shape} checkpoint in {folder}")
            make_source(shape, folder)
    elif shape == "copy":  # saved at an earlier export shape: widened again, not trained
        import importlib

        importlib.import_module(f"_bench.{TRAINED_SHAPES[shape][1]}").regrow(folder, _log)
    return folder


def lm_head_clash(config: dict) -> list[str]:
    """The layer projections of a llama/qwen2 `config` whose output size equals vocab_size.

    onnxruntime-genai's builder walks model.modules() and takes the first nn.Linear with
    out_features == vocab_size for the lm_head (builders/base.py, `has_lm_head`); a layer's
    projection of that size comes first, so the logits are read after that layer's norm and
    the export computes something else, silently. An empty list: no such projection."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {"q_proj": config["num_attention_heads"] * head_dim,
             "k_proj/v_proj": config.get("num_key_value_heads",
                                         config["num_attention_heads"]) * head_dim,
             "o_proj/down_proj (hidden_size)": config["hidden_size"],
             "gate_proj/up_proj (intermediate_size)": config["intermediate_size"]}
    return [name for name, size in sizes.items() if size == config["vocab_size"]]


def build_onnx(root: Path, shape: str, precision: str, stage: Path) -> None:
    """The builder's CPU export of the shape's checkpoint, with search.max_length set."""
    src = source(root, shape)
    clash = lm_head_clash(json.loads((src / "config.json").read_text()))
    if clash:
        raise SystemExit(f"{src}: the genai builder would take {', '.join(clash)} (output size "
                         "= vocab_size) for the lm_head; change the shape")
    _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(src), "-i",
          str(src), "-o", str(stage), *BUILDER_PRECISION_ARGS[precision], "-e", "cpu", "-c",
          str(root / ".builder-cache")])
    config_path = stage / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["search"]["max_length"] = MAX_LENGTH
    config_path.write_text(json.dumps(config, indent=4) + "\n")


def _llama_cpp_tree(root: Path, sdist: Path) -> Path:
    """llama.cpp's converter and gguf-py, extracted from llama-cpp-python's sdist (once)."""
    tree = root / ".llama-cpp" / sdist.name.removesuffix(".tar.gz")
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    stage = tree.with_name(tree.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            _, _, inner = member.name.partition("/")
            if not inner.startswith(SDIST_VENDOR) or not member.isfile():
                continue
            relative = inner.removeprefix(SDIST_VENDOR)
            if ".." in Path(relative).parts:
                raise SystemExit(f"{sdist}: member {member.name!r} leaves its folder")
            if relative.startswith(("convert_hf_to_gguf.py", "conversion/", "gguf-py/")):
                target = stage / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                extracted = archive.extractfile(member)
                if extracted is None:
                    raise SystemExit(f"{sdist}: member {member.name!r} cannot be read")
                target.write_bytes(extracted.read())
    tree.parent.mkdir(parents=True, exist_ok=True)
    os.replace(stage, tree)
    return tree


def build_gguf(root: Path, shape: str, quant: str, stage: Path, sdist: Path | None,
               llama_python: Path | None) -> None:
    """The shape's checkpoint as a GGUF file at `quant` (q8_0 by the converter; q4_0 by
    llama.cpp's quantizer from an f16 conversion)."""
    if sdist is None:
        sdist = default_sdist(root)
    if not sdist.is_file():
        raise SystemExit(f"{shape}-{quant}: no llama-cpp-python sdist at {sdist} "
                         "(--llama-cpp-sdist)")
    tree = _llama_cpp_tree(root, sdist)
    src = source(root, shape)
    converter = Path(__file__).resolve().parent / "_bench" / "gguf_convert.py"
    pre_tokenizer = (TRAINED_GGUF_PRE_TOKENIZER[shape] if shape in TRAINED_SHAPES
                     else SHAPES[shape].gguf_pre_tokenizer)
    if quant in ("q8_0", "f32"):
        _run([sys.executable, str(converter), str(tree), pre_tokenizer,
              str(src), "--outtype", quant, "--outfile", str(stage)])
        return
    if llama_python is None:
        llama_python = venvs.python(venvs.LLAMACPP)
    if not llama_python.exists():
        raise SystemExit(f"{shape}-{quant}: no interpreter at {llama_python} "
                         "(--llama-cpp-python)")
    f16 = stage.with_name(stage.name + ".f16")
    _run([sys.executable, str(converter), str(tree), pre_tokenizer, str(src),
          "--outtype", "f16", "--outfile", str(f16)])
    try:
        _run([str(llama_python), str(converter.with_name("gguf_quantize.py")), str(f16),
              str(stage), quant])
    finally:
        f16.unlink(missing_ok=True)


def _versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for dist in ("onnxruntime-genai", "torch", "transformers", "onnx", "onnxscript"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def build(root: Path, name: str, args: argparse.Namespace) -> None:
    shape, precision = parse_name(name)
    final = root / name
    if (final / "BUILD.json").is_file() and not args.force:
        _log(f"{name}: already built in {final}")
        return
    started = time.monotonic()
    stage = root / f".{name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    _log(f"{name}: building")
    if precision in ONNX_PRECISIONS:
        build_onnx(root, shape, precision, stage)
    else:
        stage.mkdir(parents=True)
        build_gguf(root, shape, precision, stage / f"{name}.gguf", args.llama_cpp_sdist,
                   args.llama_cpp_python)
    if shape in TRAINED_SHAPES:
        training = json.loads((root / ".sources" / shape / "TRAINING.json").read_text())
        config = json.loads((root / ".sources" / shape / "config.json").read_text())
        described = {"seed": training["seed"], "config": config, "training": training}
    else:
        described = {"seed": SEED, "config": SHAPES[shape].config}
    record = {"name": name, "shape": shape, "precision": precision, **described,
              "max_length": MAX_LENGTH,
              "bytes": _folder_bytes(stage), "build_s": round(time.monotonic() - started, 1),
              "versions": _versions(),
              "llama_cpp_sdist": args.llama_cpp_sdist.name if args.llama_cpp_sdist else None}
    (stage / "BUILD.json").write_text(json.dumps(record, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    _log(f"{name}: {record['bytes'] / 2**20:.0f} MiB in {record['build_s']:.0f} s -> {final}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=BENCH_MODELS, metavar="NAME",
                        help=f"models to build: {', '.join(BENCH_MODELS)}")
    parser.add_argument("--root", type=Path, default=None,
                        help="cache folder (default $ONNX_CHUNK_BENCH_MODELS or "
                             "~/.cache/onnx-chunk/bench-models)")
    parser.add_argument("--force", action="store_true", help="rebuild models already built")
    parser.add_argument("--llama-cpp-sdist", type=Path, default=None,
                        help="llama-cpp-python's sdist (its vendored llama.cpp converter; "
                             "default: downloaded into the cache once)")
    parser.add_argument("--llama-cpp-python", type=Path, default=None,
                        help="interpreter of a venv with llama-cpp-python (its quantizer; "
                             "default: the `llamacpp` scratch venv, built on first use)")
    args = parser.parse_args(argv)
    python = exporters_python()
    if python is not None:
        return subprocess.run([str(python), str(Path(__file__).resolve()),
                               *(sys.argv[1:] if argv is None else argv)], check=False).returncode
    root = models_root(args.root)
    root.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        build(root, name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
