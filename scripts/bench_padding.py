"""Table 4: end-to-end time with query-axis padding on against off, per mask policy and mode.

One measurement is a fresh process that serves the workload (prompts of 40 to 900 tokens, in
that order, 32 new tokens each) with one runtime, so every width a configuration meets is
created (compiled) on first use and counted in the request that needs it, as in serving.
Nothing is created ahead of time on either side. Two session modes: the CPU default (one
shape-generic session, where a padded chunk only computes more rows) and per-width variants
(`specialize=True`, the CUDA default, where padding decides how many variants are built).
Configurations (mode x mask policy x padding on/off) run interleaved.

    .venv/bin/python scripts/bench_padding.py [--variant int4]
"""

from __future__ import annotations

import sys

from _bench import environment as env
from _bench.child import publish, run_child
from _bench.harness import (
    CHUNK_SIZE,
    NEW_TOKENS,
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
)

from onnx_chunk.runtime import MaskPolicy

WORKLOAD = (40, 150, 300, 600, 900)
# Session modes: the label in the table and the `specialize` handed to the runtime.
MODES = {"one session": None, "per-width": True}


def _name(mode: str, policy: str, padding: bool) -> str:
    return f"{mode}/{policy}/{'on' if padding else 'off'}"


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    repetitions, new_tokens = (2, 8) if args.quick else (args.repetitions, NEW_TOKENS)
    workload = (40, 150, 300) if args.quick else WORKLOAD
    model = env.source_model(args, "bench")
    config = env.model_config(model)
    prompts = [seeded_prompt(length, config["vocab_size"]) for length in workload]
    policies = [policy.value for policy in MaskPolicy]
    systems = tuple(_name(mode, policy, padding) for mode in MODES for policy in policies
                    for padding in (True, False))

    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(repetitions):
        for system in round_order(systems, round_index):
            mode, policy, switch = system.split("/")
            child = run_child(env.worker_argv(sys.executable, "chunk_worker", {
                "model": str(model), "prompts": prompts, "new_tokens": new_tokens,
                "chunk_size": CHUNK_SIZE, "padding": switch == "on", "mask_policy": policy,
                "specialize": MODES[mode], "warm": False, "eos": config["eos_token_ids"]}),
                timeout_s=900)
            payload = child.payload
            runs[system].append({"total_s": [r["total_s"] for r in payload["results"]],
                                 "compiles": payload["compiles"], "load_s": payload["load_s"]})
            print(f"round {round_index + 1}/{repetitions} {system:<25} "
                  f"{sum(r['total_s'] for r in payload['results']):.2f} s, "
                  f"{payload['compiles']} compiles", file=sys.stderr)

    rows = []
    for mode in MODES:
        for policy in policies:
            on, off = runs[_name(mode, policy, True)], runs[_name(mode, policy, False)]
            for index, length in enumerate(workload):
                a = summarize(run["total_s"][index] for run in on)
                b = summarize(run["total_s"][index] for run in off)
                rows.append([mode, policy, length, format_value(a, 3), format_value(b, 3),
                             f"{ratio(a, b):.2f}x"])
            a = summarize(sum(run["total_s"]) for run in on)
            b = summarize(sum(run["total_s"]) for run in off)
            rows.append([mode, policy,
                         f"all ({on[0]['compiles']} vs {off[0]['compiles']} compiles)",
                         format_value(a, 3), format_value(b, 3), f"{ratio(a, b):.2f}x"])
    table = markdown_table(["mode", "mask policy", "prompt", "end-to-end s padding on",
                            "end-to-end s padding off", "on / off"], rows)
    name = f"padding_{args.variant}{'_quick' if args.quick else ''}"
    results = {"variant": args.variant, "repetitions": repetitions, "new_tokens": new_tokens,
               "workload": list(workload), "runs": runs}
    publish(args.out, name, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
