"""Structured output's cost: decode tokens/s with a JSON schema against without (goal >= 0.8x).

Both systems sample at temperature 1 on the same runtime, one request at a time, MAX_NEW new
tokens each (free text ignores EOS; the schema, 16 records of a name, an age, a kind and a
flag, is longer than MAX_NEW tokens, so both run the full length). Tokens/s is the runtime's
own decode rate of each request (`Completion.stats.decode_tokens_per_s`, counted from its
token events); the schema's side includes compiling the schema per request, as the server
does. Systems are interleaved, the first rotating each round; medians and spread; the load
average before and after.

The full run uses the `bench` reference decoder (vocabulary 32000) with a byte-level BPE of
32000 tokens trained here on Python's standard library sources (once, kept beside the model);
`--quick` is a smoke run on a fixture export (vocabulary 384).

    .venv/bin/python scripts/bench_structured.py [--quick] [--repetitions 5]
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

from _bench import environment as env
from _bench.child import publish
from _bench.harness import decode_ratio_result, decode_rounds

FREE, SCHEMA = "free text", "JSON schema"
GOAL = 0.8
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog", "bird", "fish"]},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "kind", "ok"], "additionalProperties": False}
DOCUMENT = {"type": "array", "items": RECORD, "minItems": 16, "maxItems": 16}
FULL = {"requests": 4, "new_tokens": 128}
QUICK = {"requests": 2, "new_tokens": 16}
FIXTURE = env.ROOT / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0], variant=False)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    repetitions = 2 if args.quick else args.repetitions
    if args.model is not None:
        model = env.named_export(args.model)[1]
    else:
        model = FIXTURE if args.quick else _bench_model(args.out)
    from onnx_chunk.runtime import load
    from onnx_chunk.sampling import Sampling
    from onnx_chunk.structured import json_constraint
    from onnx_chunk.text.generation import generate_text
    from onnx_chunk.text.tokenizer import tokenizer_of

    load_before = os.getloadavg()
    with load(model, provider="cpu") as runtime:
        tokenizer = tokenizer_of(runtime)
        base = Sampling(temperature=1.0)
        json_constraint(tokenizer, DOCUMENT, runtime.stats.vocab_size)  # tokenizer prep, once

        def run_round(system: str, round_index: int) -> tuple[list[float], int]:
            rates, tokens = [], 0
            for request in range(plan["requests"]):
                sampling = replace(base, seed=round_index * 1000 + request)
                if system == SCHEMA:
                    sampling = replace(sampling, constraint=json_constraint(
                        tokenizer, DOCUMENT, runtime.stats.vocab_size))
                completion = generate_text(runtime, "Records:", plan["new_tokens"],
                                           sampling=sampling, ignore_eos=system == FREE)
                stats = completion.stats
                assert stats is not None and stats.decode_tokens_per_s is not None
                rates.append(stats.decode_tokens_per_s)
                tokens += len(completion.tokens)
            return rates, tokens

        runs = decode_rounds((FREE, SCHEMA), repetitions, run_round)
    data, table = decode_ratio_result(
        runs, FREE, SCHEMA, GOAL,
        f"model {model.name if model.is_dir() else model.parent.name}, "
        f"{plan['requests']} requests x {plan['new_tokens']} new tokens per round",
        plan, repetitions, load_before)
    publish(args.out, "structured" + ("_quick" if args.quick else ""), data, table)
    return 0


def _bench_model(out: Path) -> Path:
    """The bench decoder with a 32000-token byte-level BPE beside it (trained once)."""
    model = env.build_model(out, "bench")
    folder = model.parent
    if not (folder / "tokenizer.json").is_file():
        vocab = env.model_config(model)["vocab_size"]
        _train_tokenizer(vocab).save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    return model


def _train_tokenizer(vocab_size: int):
    """A GPT-2 style byte-level BPE of `vocab_size` tokens (ids 0-2: <pad>, <s>, </s>, the
    bench decoder's pad, BOS and EOS) trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = [path for path in sorted(glob.glob(
        str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True))
        if _utf8(path)]  # a few test files of the standard library are in other encodings
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], max_token_length=16,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(f"the tokenizer trained to {tokenizer.get_vocab_size()} tokens, not "
                         f"{vocab_size}: the corpus is too small")
    return tokenizer


def _utf8(path: str) -> bool:
    try:
        Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
