"""Peak memory of a static decoder's prefill at two chunk sizes: what c buys (issue 6).

One static pair (chunk graph at rows c, decode graph at rows 1, capacity C = L + new tokens) is
built per chunk size from the same preset and seed. Each measurement runs in a process of its
own, and its peak resident set is that process's own (`wait4`'s ru_maxrss, via
scripts/_bench/child.py): once opening the two sessions only ("load"), once opening them and
prefilling an L-token prompt ("prefill"). Prefill minus load is what the forward adds: mostly
the c x C attention scores per head and the other activations of c rows, which ONNX Runtime's
arena keeps. Medians over the repetitions; the order of chunk sizes rotates per round.

    .venv/bin/python scripts/static_memory.py [--preset small] [--max-input-len 1024]
        [--chunk-sizes 64,1024] [--new-tokens 64] [--repetitions 3] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _bench.child import run_child, write_text
from _bench.harness import markdown_table, round_order, summarize

MODES = ("load", "prefill")


def _child(request: dict) -> dict:
    """In the measurement process: open the pair, optionally prefill; report times."""
    from onnx_chunk.static import load_static

    began = time.perf_counter()
    runner = load_static(request["model"], max_input_len=request["max_input_len"],
                         provider="cpu")
    loaded = time.perf_counter()
    result = {"load_s": loaded - began}
    if request["mode"] == "prefill":
        prompt = [3 + index % (runner.vocab_size - 3) for index in range(request["max_input_len"])]
        prefill = runner.start(prompt, request["new_tokens"])
        result.update(prefill_s=time.perf_counter() - loaded, chunks=prefill.chunks)
    return result


def _build(folder: Path, preset: str, chunk_size: int, capacity: int) -> Path:
    from onnx_chunk.models.static_decoder import build_static_pair

    chunk, _ = build_static_pair(folder, preset, chunk_size=chunk_size, capacity=capacity)
    return chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-input-len", type=int, default=1024, help="L")
    parser.add_argument("--chunk-sizes", default="64,1024",
                        help="comma-separated chunk sizes c; each must divide L")
    parser.add_argument("--new-tokens", type=int, default=64, help="C = L + this")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the table to OUT/static_memory.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    length = args.max_input_len
    capacity = length + args.new_tokens
    sizes = [int(word) for word in args.chunk_sizes.split(",")]
    systems = [f"c={size}" for size in sizes]
    samples: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory(prefix="static-memory-") as scratch:
        models = {name: _build(Path(scratch) / name, args.preset, size, capacity)
                  for name, size in zip(systems, sizes)}
        for round_index in range(args.repetitions):
            for name in round_order(systems, round_index):
                for mode in MODES:
                    request = {"model": str(models[name]), "mode": mode,
                               "max_input_len": length, "new_tokens": args.new_tokens}
                    result = run_child([sys.executable, __file__, "--child", json.dumps(request)],
                                       timeout_s=600)
                    samples.setdefault((name, mode), []).append(result)
    rows = []
    for name, size in zip(systems, sizes):
        load = summarize([run.peak_rss_mb for run in samples[(name, "load")]]).median
        peak = summarize([run.peak_rss_mb for run in samples[(name, "prefill")]]).median
        seconds = summarize([run.payload["prefill_s"] for run in samples[(name, "prefill")]])
        chunks = samples[(name, "prefill")][0].payload["chunks"]
        rows.append([str(size), str(chunks), f"{load:.0f}", f"{peak:.0f}", f"{peak - load:.0f}",
                     f"{seconds.median * 1000:.0f}"])
    table = markdown_table(["c", "chunks", "load peak RSS MiB", "prefill peak RSS MiB",
                            "prefill adds MiB", "prefill ms"], rows)
    text = (f"preset {args.preset}, L={length}, C={capacity}, CPU provider, one L-token prompt, "
            f"medians of {args.repetitions} runs per row\n\n{table}\n")
    print(text)
    if args.out is not None:
        write_text(args.out / "static_memory.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
