"""The grammar libraries for structured output, side by side on one tokenizer.json.

For llguidance, xgrammar and outlines-core (each where it is importable; run it in a scratch
venv holding all three, never the project's): the one-off tokenizer preparation, the
compilation of a JSON schema (per request in a server), and the time of each token mask
along a valid document of that schema (mean, median, p90, max over the document's tokens,
medians over repetitions), plus the installed size of each library and of what it requires.
The tokenizer is byte-level BPE (GPT-2 style); trained ones of 32k-150k tokens stand in for
real ones (`--train N` trains one on the standard library's sources, tokens capped at 16
bytes as real vocabularies are).

    python scripts/bench_grammar_libraries.py --tokenizer tokenizer.json [--repetitions 3]
    python scripts/bench_grammar_libraries.py --train 150000 --out bench-out
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "kind": {"enum": ["person", "robot", "other"]}},
    "required": ["name", "age", "tags", "address", "kind"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace of the analytical engine", "age": 36,
                       "tags": ["math", "poetry", "engines", "notes"],
                       "address": {"city": "London", "zip": "12345"}, "kind": "person"},
                      separators=(",", ":"))
DISTRIBUTIONS = {"llguidance": "llguidance", "xgrammar": "xgrammar",
                 "outlines-core": "outlines_core"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (byte-level BPE)")
    parser.add_argument("--train", type=int, help="train a byte-level BPE of this many tokens")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    path = args.tokenizer or _trained(args.train, args.out)
    tokenizer = Tokenizer.from_file(str(path))
    words = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = tokenizer.token_to_id("</s>") or tokenizer.token_to_id("<|endoftext|>") or 0
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False).ids
    print(f"{path}: {words} tokens; document of {len(ids)} tokens; load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, measure in (("llguidance", _llguidance), ("xgrammar", _xgrammar),
                          ("outlines-core", _outlines)):
        try:
            __import__(DISTRIBUTIONS[name])
        except ImportError:
            print(f"{name}: not installed, skipped")
            continue
        runs = [measure(tokenizer, words, eos, ids) for _ in range(args.repetitions)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{name} ({_footprint(name)}): tokenizer {median['tokenizer_ms']:.0f} ms, "
              f"schema {median['compile_ms']:.1f} ms; mask per token mean "
              f"{median['mean_ms']:.3f} ms, median {median['median_ms']:.3f}, p90 "
              f"{median['p90_ms']:.3f}, max {median['max_ms']:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


def _llguidance(tokenizer, words: int, eos: int, ids: list[int]) -> dict:
    import llguidance

    start = time.perf_counter()
    grammar_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=words,
                                               eos_token=eos)
    prepared = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(grammar_tokenizer, grammar)
    compiled = time.perf_counter()
    mask = np.empty((words + 31) // 32, dtype=np.int32)
    times = []
    for token in ids:
        begin = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - begin)
        _check(mask, token)
        matcher.consume_token(token)
    return _timings(prepared - start, compiled - prepared, times)


def _xgrammar(tokenizer, words: int, eos: int, ids: list[int]) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(_token_bytes(tokenizer, words),
                                  vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    prepared = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                    separators=(",", ":"))
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    compiled = time.perf_counter()
    mask = xgrammar.allocate_token_bitmask(1, words)
    times = []
    for token in ids:
        begin = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - begin)
        _check(mask.numpy()[0], token)
        matcher.accept_token(token)
    return _timings(prepared - start, compiled - prepared, times)


def _outlines(tokenizer, words: int, eos: int, ids: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    vocabulary: dict[bytes, list[int]] = {}
    for index, piece in enumerate(_token_bytes(tokenizer, words)):
        if index != eos:
            vocabulary.setdefault(piece, []).append(index)
    prepared_vocabulary = outlines_core.Vocabulary(eos, vocabulary)
    prepared = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    guide = outlines_core.Guide(outlines_core.Index(regex, prepared_vocabulary))
    compiled = time.perf_counter()
    mask = np.empty((words + 31) // 32, dtype=np.int32)
    times = []
    for token in ids:
        begin = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - begin)
        _check(mask, token)
        guide.advance(token)
    return _timings(prepared - start, compiled - prepared, times)


def _check(mask: np.ndarray, token: int) -> None:
    if not (int(mask[token // 32]) >> (token % 32)) & 1:
        raise SystemExit(f"the mask forbids token {token} of the valid document")


def _timings(prepare_s: float, compile_s: float, times: list[float]) -> dict:
    ordered = sorted(times)
    return {"tokenizer_ms": 1000 * prepare_s, "compile_ms": 1000 * compile_s,
            "mean_ms": 1000 * statistics.mean(times), "median_ms": 1000 * ordered[len(times) // 2],
            "p90_ms": 1000 * ordered[int(0.9 * len(times))], "max_ms": 1000 * ordered[-1]}


def _token_bytes(tokenizer, words: int) -> list[bytes]:
    """Each id's bytes: byte-level BPE strings mapped back through GPT-2's byte alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]
    decode = {chr(byte): byte for byte in printable}
    decode.update({chr(256 + index): byte for index, byte in enumerate(shifted)})
    pieces = [b""] * words
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        try:
            pieces[index] = bytes(decode[char] for char in token)
        except KeyError:  # an added token, written as itself
            pieces[index] = token.encode()
    return pieces


def _footprint(name: str) -> str:
    """The installed size of `name` and of everything it requires, recursively."""
    seen: set[str] = set()
    pending = [name]
    total = 0
    while pending:
        current = pending.pop()
        if current.lower() in seen:
            continue
        seen.add(current.lower())
        try:
            distribution = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(file.size or 0 for file in distribution.files or ())
        for requirement in distribution.requires or ():
            if "extra ==" not in requirement:
                pending.append(requirement.split(";")[0].split("[")[0].split("<")[0]
                               .split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip())
    own = sum(file.size or 0 for file in importlib.metadata.distribution(name).files or ())
    return f"{own / 2**20:.1f} MiB, {total / 2**20:.0f} MiB with its {len(seen) - 1} requirements"


def _trained(size: int | None, out: Path) -> Path:
    if size is None:
        raise SystemExit("give --tokenizer PATH or --train N")
    path = out / f"bpe-{size}.json"
    if not path.is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"),
                                 recursive=True))
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train(files, trainers.BpeTrainer(
            vocab_size=size, special_tokens=["<pad>", "<s>", "</s>"], max_token_length=16,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return path


if __name__ == "__main__":
    sys.exit(main())
