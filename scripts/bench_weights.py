"""Weights held once however many variants exist (issue 5): resident memory per variant added.

onnx-chunk's variants (one session per query width, every one handed the same weight buffers,
faulted in at load), onnx-chunk's CPU default (one shape-generic session that loads its own
weights and runs every width) and one plain ONNX Runtime session per width that loads the model
itself. Each mode runs in its own process, interleaved, repeated; medians of the resident set
after each width. "variant bytes held" is the cache's reading of the per-width variants, which
never includes the shared weights (read once at load: "weights resident").

    .venv/bin/python scripts/bench_weights.py [--variant int4] [--quick]
"""

from __future__ import annotations

import sys

from _bench import environment as env
from _bench.child import run_child, write_json, write_text
from _bench.harness import markdown_table, round_order, summarize

MODES = ("shared", "generic", "naive")
WIDTHS = (1, 171, 342, 512)
MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    repetitions = 2 if args.quick else args.repetitions
    model = env.source_model(args, "bench")
    weights_mib = sum(path.stat().st_size for path in model.parent.glob("*.data")) / MIB
    samples: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    for round_index in range(repetitions):
        for mode in round_order(MODES, round_index):
            request = {"model": str(model), "mode": mode, "widths": list(WIDTHS)}
            result = run_child(env.worker_argv(sys.executable, "weights_worker", request),
                               timeout_s=600)
            samples[mode].append(result.payload["rows"])
    rows = []
    for index, width in enumerate(WIDTHS):
        shared = summarize([run[index]["rss"] / MIB for run in samples["shared"]])
        generic = summarize([run[index]["rss"] / MIB for run in samples["generic"]])
        naive = summarize([run[index]["rss"] / MIB for run in samples["naive"]])
        held = samples["shared"][-1][index]["bytes_held"] / MIB
        rows.append([str(index + 1), str(width), f"{shared.median:.0f}", f"{generic.median:.0f}",
                     f"{naive.median:.0f}", f"{naive.median / shared.median:.2f}x",
                     f"{held:.1f}"])
    resident = samples["shared"][-1][0]["weights_resident"] / MIB
    table = markdown_table(
        ["variants", "width added", "onnx-chunk variants RSS MiB",
         "onnx-chunk one session RSS MiB", "one session each RSS MiB", "ratio (each/variants)",
         "variant bytes held MiB"], rows)
    text = (f"bench decoder ({args.variant}), external weights {weights_mib:.0f} MiB "
            f"(variants mode: {resident:.0f} MiB resident from load, the runtime's), "
            f"{repetitions} runs per mode, medians\n\n{table}\n")
    print(text)
    write_text(args.out / f"weights_{args.variant}.md", text)
    write_json(args.out / f"weights_{args.variant}.json", samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
