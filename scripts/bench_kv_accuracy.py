"""What a quantized KV cache costs in accuracy on a trained decoder (docs/kv_cache.md, Accuracy).

Usage: bench_kv_accuracy.py [MODEL] [--out DIR] [--window 256] [--new-tokens 256] [--prompts 4]

MODEL is a built benchmark model (default ``text-fp32``, the decoder trained on English licence
texts by scripts/make_bench_models.py) or a builder-export folder. The float export is converted
five times with the command line users run, ``onnx-chunk convert`` (float32: no --kv-dtype;
int8 and int4, each with ``--kv-scales per-channel`` and ``per-tensor``), calibrated with
``--calibrate`` on a file of training text (prompts of about --calibration-chars characters of
the training licences, never the held-back one), and each converted folder is then loaded with
``onnx_chunk.load`` and measured on the held-back text (Apache-2.0, which neither the tokenizer
nor the model saw; text_decoder.py):

* perplexity: the held-back tokens in non-overlapping windows of --window tokens, each window a
  fresh sequence prefilled in chunks of --chunk-size with every row's logits
  (``Sequence.prefill(ids, all_logits=True)``), every token but a window's first scored: the same
  windows as the torch perplexity TRAINING.json records, printed beside it;
* row agreement: over those rows, the share whose argmax equals the float32 cache's;
* greedy agreement: --prompts prompts of --prompt-tokens held-back tokens (evenly spaced); the
  float32 cache's greedy continuation of --new-tokens tokens, then each cache's argmax at every
  one of those positions, teacher-forced on the float32 tokens (prefill of prompt + continuation
  with all rows' logits): the share equal to the float32 token. Free-running, each cache's own
  greedy continuation: the first position where it leaves the float32 one (none: all equal);
* clipping: how far the held-back keys and values go past the calibrated ranges, per channel
  and per tensor (`calibrate_kv` run on the held-back windows too).

Prints a markdown table with the command, the CPU and the load average; --json writes every
number. `--quick` is a smoke run (windows of 32, 16 new tokens, 2 prompts, 4 windows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import text_decoder  # noqa: E402
from _bench.harness import markdown_table  # noqa: E402
from _bench.models import BenchModelMissing, model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-out" / "kv-accuracy"
# (name, --kv-dtype, --kv-scales); the first is the reference.
CACHES = (("float32", None, None), ("int8 per-channel", "int8", "per-channel"),
          ("int8 per-tensor", "int8", "per-tensor"), ("int4 per-channel", "int4", "per-channel"),
          ("int4 per-tensor", "int4", "per-tensor"))


class BadInput(Exception):
    """A command-line value the benchmark cannot use (one error line, exit 2)."""


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_description() -> str:
    """The CPU model and its widest vector extension (AVX-512, AVX2 or neither)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    vector = ("AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags
              else "no AVX2")
    return f"{model}, {vector}, {os.cpu_count()} cores"


def calibration_prompts(lines: list[str], count: int, chars: int) -> list[str]:
    """`count` prompts of consecutive training lines joined by spaces, each about `chars`
    characters, taken evenly over the training text."""
    groups, current = [], []
    for line in lines:
        current.append(line)
        if sum(len(each) + 1 for each in current) >= chars:
            groups.append(" ".join(current))
            current = []
    if current:
        groups.append(" ".join(current))
    if len(groups) <= count:
        return groups
    return [groups[index * len(groups) // count] for index in range(count)]


def convert(folder: Path, out: Path, name: str, options: list[str]) -> tuple[Path, list[str]]:
    """`onnx-chunk convert FOLDER -o out/<name> OPTIONS` (rewritten each run); the converted
    folder and the command."""
    target = out / name.replace(" ", "-")
    command = [sys.executable, "-m", "onnx_chunk", "convert", str(folder), "-o", str(target),
               "--quiet", *options]
    if target.exists():
        import shutil

        shutil.rmtree(target)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[2:])}` exited {done.returncode}: "
                           + (done.stdout + done.stderr).strip().splitlines()[-1:][0])
    return target, command


def kv_options(kv_dtype: str | None, kv_scales: str | None, calibration: Path) -> list[str]:
    """The convert options of one cache of CACHES (none for float32)."""
    if kv_dtype is None:
        return []
    assert kv_scales is not None, "a quantized cache names its scales"
    return ["--kv-dtype", kv_dtype, "--kv-scales", kv_scales, "--calibrate", str(calibration)]


def clipping(folder: Path, calibration: Path, windows: list[list[int]]) -> dict:
    """How far the held-back windows' keys and values go past the calibrated ranges
    (`calibrate_kv` on both): per cache input, the channels whose held-back largest magnitude
    exceeds the calibrated one, the largest such ratio, and the per-tensor ratio."""
    import numpy as np

    from onnx_chunk.calibration import calibrate_kv, read_calibration_file

    calibrated = calibrate_kv(folder, read_calibration_file(calibration)).ranges
    held = calibrate_kv(folder, windows).ranges
    found = {}
    for name, kv_range in calibrated.items():
        ratio = held[name].amax / np.maximum(kv_range.amax, np.finfo(np.float32).tiny)
        found[name] = {"channels": int(ratio.size), "channels_over": int((ratio > 1).sum()),
                       "worst_channel": float(ratio.max()),
                       "tensor": float(held[name].amax.max() / kv_range.amax.max())}
    return found


def _log_softmax(logits):
    import numpy as np

    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def measure(folder: Path, windows: list[list[int]], prompts: list[list[int]], new_tokens: int,
            reference: dict | None, chunk_size: int, threads: int) -> dict:
    """One converted folder on the held-back windows and prompts (see the module docstring);
    `reference` is the float32 cache's result (None: this is it)."""
    import numpy as np

    import onnx_chunk

    longest = max([len(each) for each in windows]
                  + [len(prompt) + new_tokens for prompt in prompts])
    began = time.monotonic()
    with onnx_chunk.load(folder, provider="cpu", capacity=longest + 1, chunk_size=chunk_size,
                         intra_op_threads=threads) as runtime:
        nll, scored, argmax = 0.0, 0, []
        for ids in windows:
            with runtime.open_sequence() as sequence:
                logits = np.asarray(sequence.prefill(ids, all_logits=True))
            rows = _log_softmax(logits[:-1])
            nll -= float(rows[np.arange(len(ids) - 1), ids[1:]].sum())
            scored += len(ids) - 1
            argmax.append(logits[:-1].argmax(axis=-1).tolist())
        free, forced = [], []
        for index, prompt in enumerate(prompts):
            with runtime.open_sequence() as sequence:
                free.append(sequence.generate(prompt, new_tokens, eos_token_id=[]))
            path = (reference or {"free": free})["free"][index]
            with runtime.open_sequence() as sequence:
                logits = np.asarray(sequence.prefill(prompt + path[:-1], all_logits=True))
            forced.append(logits[len(prompt) - 1:].argmax(axis=-1).tolist())
        stats = runtime.stats
    result: dict[str, Any] = {
              "folder": str(folder), "kv_dtype": stats.kv_dtype, "kv_bytes": stats.kv_bytes,
              "tokens_scored": scored, "nll": nll / scored,
              "perplexity": math.exp(nll / scored), "argmax": argmax, "free": free,
              "forced": forced, "seconds": round(time.monotonic() - began, 1)}
    return agreement(result, reference or result)


def agreement(result: dict, base: dict) -> dict:
    """`result` (nll, tokens_scored, argmax, free, forced along `base`'s free paths) with its
    agreement with `base` added: row argmax, teacher-forced greedy, free-running."""
    argmax, free, forced = result["argmax"], result["free"], result["forced"]
    rows_same = sum(a == b for mine, theirs in zip(argmax, base["argmax"])
                    for a, b in zip(mine, theirs))
    result["row_agreement"] = rows_same / result["tokens_scored"]
    positions = sum(len(path) for path in base["free"])
    result["greedy_agreement"] = sum(a == b for mine, path in zip(forced, base["free"])
                                     for a, b in zip(mine, path)) / positions
    result["first_divergence"] = [next((at for at, (a, b) in enumerate(zip(mine, path))
                                        if a != b), None)
                                  for mine, path in zip(free, base["free"])]
    result["free_same"] = sum(a == b for mine, path in zip(free, base["free"])
                              for a, b in zip(mine, path)) / positions
    return result


def divergence(values: list[int | None], new_tokens: int) -> str:
    return ", ".join("none" if value is None else str(value) for value in values) + \
        f" (of {new_tokens})"


def add_held_out_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the held-back text and how it is measured (shared with
    bench_int4_accuracy.py)."""
    parser.add_argument("--held-out", type=Path, default=None,
                        help="evaluation text (default the held-back licence, "
                             f"{text_decoder.LICENSES / text_decoder.HELD_OUT_FILE})")
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--max-windows", type=int, default=None,
                        help="score at most this many windows (default all)")
    parser.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4, help="greedy prompts")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--chunk-size", type=int, default=64, help="prefill chunk rows")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: windows of 32, 4 windows, 2 prompts of 16 new tokens")


def check_held_out_arguments(args: argparse.Namespace, names: tuple[str, ...] = ()) -> None:
    """--quick's settings, then every count at least 1 (a window at least 2): BadInput."""
    if args.quick:
        args.window, args.max_windows, args.prompts, args.new_tokens = 32, 4, 2, 16
        args.prompt_tokens = 16
    for name in ("window", "new_tokens", "prompts", "prompt_tokens", "chunk_size", "threads",
                 *names):
        if getattr(args, name) < (2 if name == "window" else 1):
            raise BadInput(f"--{name.replace('_', '-')} must be at least "
                           f"{2 if name == 'window' else 1}, not {getattr(args, name)}")
    if args.max_windows is not None and args.max_windows < 1:
        raise BadInput(f"--max-windows must be at least 1, not {args.max_windows}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="text-fp32",
                        help="built benchmark model name or export folder (default text-fp32)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the converted models (default bench-out/kv-accuracy)")
    parser.add_argument("--train-text", type=Path, action="append", default=None,
                        help="calibration text file (repeatable; default the training licences)")
    parser.add_argument("--calibration-prompts", type=int, default=32)
    parser.add_argument("--calibration-chars", type=int, default=1000)
    add_held_out_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.calibration_prompts = 4
        args.calibration_chars = min(args.calibration_chars, 300)
    check_held_out_arguments(args, ("calibration_prompts", "calibration_chars"))
    return args


def read_held_out(args: argparse.Namespace) -> str:
    """--held-out's text, else the held-back licence (BadInput when it cannot be had)."""
    try:
        return (_read_text(args.held_out, "held-out text") if args.held_out
                else text_decoder.held_out_text())
    except text_decoder.LicensesMissing as error:
        raise BadInput(str(error)) from error


def _read_text(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read the {what} {str(path)!r} as UTF-8 text: {error}") from error
    if not text.strip():
        raise BadInput(f"the {what} {str(path)!r} is empty")
    return text


def held_out_inputs(folder: Path, held: str, args: argparse.Namespace
                    ) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The held-back text's token ids, its perplexity windows (--window, --max-windows) and
    its greedy prompts (--prompts of --prompt-tokens, evenly spaced), by the folder's tokenizer."""
    from onnx_chunk.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode(held, add_special_tokens=False)
    windows = text_decoder.windows(ids, args.window)[:args.max_windows]
    starts = [index * (len(ids) - args.prompt_tokens) // args.prompts
              for index in range(args.prompts)]
    prompts = [ids[start:start + args.prompt_tokens] for start in starts]
    if len(ids) < args.prompt_tokens + args.prompts or not windows:
        raise BadInput(f"the held-out text has {len(ids)} tokens: too few for "
                       f"{args.prompts} prompts of {args.prompt_tokens} tokens")
    return ids, windows, prompts


def run(args: argparse.Namespace) -> dict:
    try:
        folder = model_folder(args.model)
    except BenchModelMissing as error:
        raise BadInput(str(error)) from error
    held = read_held_out(args)
    try:
        lines = ([line.strip() for path in args.train_text
                  for line in _read_text(path, "training text").splitlines() if line.strip()]
                 if args.train_text else text_decoder.training_lines())
    except text_decoder.LicensesMissing as error:
        raise BadInput(str(error)) from error
    ids, windows, prompts = held_out_inputs(folder, held, args)
    args.out.mkdir(parents=True, exist_ok=True)
    calibration = args.out / "calibration.txt"
    calibration.write_text("\n".join(calibration_prompts(lines, args.calibration_prompts,
                                                         args.calibration_chars)) + "\n")
    load_before = load_average()
    results: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}
    for name, kv_dtype, kv_scales in CACHES:
        converted, command = convert(folder, args.out, name,
                                     kv_options(kv_dtype, kv_scales, calibration))
        commands[name] = " ".join(["onnx-chunk", *command[3:]])
        results[name] = measure(converted, windows, prompts, args.new_tokens,
                                results.get("float32"), args.chunk_size, args.threads)
        print(f"{name}: perplexity {results[name]['perplexity']:.4f} "
              f"({results[name]['seconds']} s)", file=sys.stderr, flush=True)
    clipped = clipping(folder, calibration, windows)
    build = folder / "BUILD.json"
    training = (json.loads(build.read_text()).get("training") if build.is_file() else None) or {}
    return {"model": str(folder), "cpu": cpu_description(), "load_before": load_before,
            "load_after": load_average(), "windows": len(windows), "window": args.window,
            "chunk_size": args.chunk_size, "held_out_tokens": len(ids),
            "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "calibration_file": str(calibration),
            "calibration_prompts": args.calibration_prompts, "convert_commands": commands,
            "torch_held_out": training.get("held_out"), "clipping": clipped,
            "results": results}


def table(report: dict, argv: list[str]) -> str:
    base = report["results"]["float32"]
    rows = []
    for name, result in report["results"].items():
        rows.append([name, f"{result['perplexity']:.4f}",
                     f"{result['perplexity'] / base['perplexity']:.4f}",
                     f"{100 * result['row_agreement']:.1f}%",
                     f"{100 * result['greedy_agreement']:.1f}%",
                     divergence(result["first_divergence"], report["new_tokens"]),
                     f"{result['kv_bytes'] / 2**10:.0f}"])
    torch = report["torch_held_out"]
    lines = [
        "`" + " ".join(["python scripts/bench_kv_accuracy.py", *argv]) + "`",
        f"CPU: {report['cpu']}; load average {report['load_before']} before, "
        f"{report['load_after']} after.",
        f"Held-back text: {report['held_out_tokens']} tokens, {report['windows']} windows of "
        f"{report['window']} (prefill chunks of {report['chunk_size']}); greedy: "
        f"{report['prompts']} prompts of {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens each.",
    ]
    if torch and torch.get("window") == report["window"] and not report.get("partial"):
        lines.append(f"Torch perplexity of the trained model on the same windows "
                     f"(TRAINING.json): {torch['perplexity']:.4f}.")
    lines += ["", markdown_table(
        ["cache", "perplexity", "ratio to float32", "row argmax = float32",
         "greedy agreement (teacher-forced)", "free-running first divergence", "KV KiB"],
        rows)]
    clipped = report["clipping"]
    worst = max(clipped, key=lambda name: clipped[name]["worst_channel"])
    most = max(clipped.values(), key=lambda each: each["channels_over"])
    lines += ["", f"Held-back text past the calibrated ranges: per channel, up to "
                  f"{most['channels_over']} of {most['channels']} channels of a cache and at "
                  f"most {clipped[worst]['worst_channel']:.2f}x ({worst}); per tensor at most "
                  f"{max(each['tensor'] for each in clipped.values()):.2f}x."]
    int8 = report["results"]["int8 per-channel"]
    change = int8["perplexity"] / base["perplexity"] - 1
    lines += ["", f"Goal: int8 per-channel perplexity within 1% of float32's: "
                  f"{'met' if change <= 0.01 else 'missed'} ({100 * change:+.2f}%); its greedy "
                  f"agreement >= 95%: {'met' if int8['greedy_agreement'] >= 0.95 else 'missed'} "
                  f"({100 * int8['greedy_agreement']:.1f}%)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
        report = run(args)
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    report["partial"] = args.max_windows is not None
    print(table(report, argv))
    if args.json is not None:
        slim = {**report, "results": {name: {key: value for key, value in result.items()
                                             if key not in ("argmax", "forced")}
                                      for name, result in report["results"].items()}}
        args.json.write_text(json.dumps(slim, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
