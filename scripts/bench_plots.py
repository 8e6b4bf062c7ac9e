"""Plots of the benchmark results (bench-out/*.json) as PNGs in docs/benchmarks/.

    .venv/bin/python scripts/bench_plots.py [--out bench-out] [--docs docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)
from _bench import environment as env  # noqa: E402
from _bench.harness import summarize  # noqa: E402


def _series(data: dict, system: str, field: str) -> tuple[list[int], list[float]]:
    lengths = data["lengths"]
    values = [summarize(run[field] for run in data["runs"][f"{length}/{system}"]).median
              for length in lengths]
    return lengths, values


def _plot(data: dict, systems: tuple[str, ...], fields: tuple[tuple[str, str], ...],
          title: str, path: Path) -> None:
    figure, axes = plt.subplots(1, len(fields), figsize=(5 * len(fields), 3.6))
    for axis, (field, label) in zip(axes, fields):
        for system in systems:
            lengths, values = _series(data, system, field)
            axis.plot(lengths, values, marker="o", label=system)
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    temporary = path.with_name(f".{path.stem}.tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    temporary.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=env.DEFAULT_OUT)
    parser.add_argument("--docs", type=Path, default=env.ROOT / "docs" / "benchmarks")
    args = parser.parse_args(argv)
    args.docs.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(args.out.glob("vs_genai_*.json")):
        data = json.loads(path.read_text())
        target = args.docs / f"{path.stem}.png"
        _plot(data, ("onnx-chunk", "genai"),
              (("ttft_s", "TTFT (s)"), ("decode_tokens_per_s", "decode tokens/s"),
               ("peak_rss_mb", "peak RSS (MB)")),
              f"onnx-chunk vs onnxruntime-genai, bench {data['variant']}, chunk "
              f"{data['chunk_size']}, median of {data['repetitions']}", target)
        written.append(target)
    for path in sorted(args.out.glob("chunking_*.json")):
        data = json.loads(path.read_text())
        target = args.docs / f"{path.stem}.png"
        _plot(data, ("chunked", "whole"), (("peak_rss_mb", "peak RSS (MB)"),
                                            ("ttft_s", "TTFT (s)")),
              f"chunked (W={data['chunk_size']}) vs whole-prompt prefill, bench "
              f"{data['variant']}, median of {data['repetitions']}", target)
        written.append(target)
    for target in written:
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
