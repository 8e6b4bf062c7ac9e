"""bench_engine.py's prefill-batching probe: would prefilling several prompts in one forward pay?

Plain ONNX Runtime on the converted model, CPU (`prefill_worker`): one forward of [2, 512]
rows against two [1, 512] forwards, [8, 40] against eight [1, 40], as batched time / serial
time (under 1.0: batching pays), and one decode forward. Beside them the FLOPs of each
forward (`flops`) and the GFLOP/s achieved, and, when the throughput part ran in the same
invocation, the GFLOP/s of its prefill and decode phases.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from onnx_chunk.models.config import DecoderConfig

from . import environment as env
from .child import run_child
from .flops import attention_flops_per_key, forward_flops, generation_flops, linear_flops_per_row
from .harness import Summary, format_value, markdown_table, summarize

GIGA = 1e9
FP32_BYTES = 4


def measure(model: Path, plan: dict, repetitions: int) -> dict:
    """The seconds of every timed forward, from one child."""
    child = run_child(env.worker_argv(sys.executable, "prefill_worker", {
        "model": str(model), "cases": plan["cases"], "decode_past": plan["decode_past"],
        "repetitions": repetitions}), timeout_s=1800)
    seconds = child.payload["seconds"]
    for case in plan["cases"]:
        name = _name(case)
        batched = summarize(seconds[name]["batched"]).median
        serial = summarize(seconds[name]["serial"]).median
        print(f"prefill probe {name}: batched {batched:.3f} s, serial {serial:.3f} s",
              file=sys.stderr)
    return {"plan": plan, "seconds": seconds}


def _gflop(flops: int) -> str:
    """GFLOP with a thousands separator, or 3 significant digits below 1."""
    gflop = flops / GIGA
    return f"{gflop:,.1f}" if gflop >= 1 else f"{gflop:.3g}"


def _name(case: list[int]) -> str:
    return f"{case[0]}x{case[1]}"


def throughput_phases(throughput: dict, lengths: list[int], new_tokens: int,
                      config: DecoderConfig) -> list[tuple[str, int, Summary, int]]:
    """(label, FLOPs, seconds, decode forwards) of the throughput part's prefill and decode
    phases, per system that reports them (decode forwards: 0 for a prefill phase)."""
    prefill = sum(generation_flops(config, length, new_tokens)[0] for length in lengths)
    decode = sum(generation_flops(config, length, new_tokens)[1] for length in lengths)
    phases = []
    for system, runs in throughput.items():
        if any("decode_s" not in run for run in runs):
            continue
        steps = round(summarize(run["decode_forwards"] for run in runs).median)
        phases += [(f"throughput part, {system}: prefill phase", prefill,
                    summarize(run["prefill_s"] for run in runs), 0),
                   (f"throughput part, {system}: decode phase", decode,
                    summarize(run["decode_s"] for run in runs), steps)]
    return phases


def table(data: dict, config: DecoderConfig,
          phases: Sequence[tuple[str, int, Summary, int]] = ()) -> str:
    """The batched/serial ratios, then the GFLOP/s of each measured forward or phase."""
    plan, seconds = data["plan"], data["seconds"]
    # fp32 matrices: a multiply-add of one row reads one 4-byte weight (the embedding is a
    # gather of one row, left out).
    weights = linear_flops_per_row(config) // 2 * FP32_BYTES
    rows = []
    for case in plan["cases"]:
        batch, width = case
        name = _name(case)
        batched, serial = (summarize(seconds[name][kind]) for kind in ("batched", "serial"))
        flops = forward_flops(config, width, batch=batch)
        rows.append([f"[{batch}, {width}] against {batch} x [1, {width}]",
                     format_value(batched, 3), format_value(serial, 3),
                     f"{batched.median / serial.median:.2f}x", _gflop(flops),
                     f"{flops / GIGA / batched.median:.1f}",
                     f"{flops / GIGA / serial.median:.1f}"])
    first = markdown_table(
        [f"prefill forward ({plan['preset']} decoder converted, plain ONNX Runtime, CPU)",
         "batched s", "serial s", "batched / serial", "GFLOP", "GFLOP/s batched",
         "GFLOP/s serial"], rows)
    past = plan["decode_past"]
    decode = summarize(seconds["decode"])
    achieved = [[f"probe: one decode forward [1, 1] after {past} cached tokens",
                 _gflop(forward_flops(config, 1, past)), format_value(decode, 4),
                 f"{forward_flops(config, 1, past) / GIGA / decode.median:.1f}",
                 f"{weights / GIGA / decode.median:.1f}"]]
    for label, flops, spent, forwards in phases:
        achieved.append([label, _gflop(flops), format_value(spent, 2),
                         f"{flops / GIGA / spent.median:.1f}",
                         f"{forwards * weights / GIGA / spent.median:.1f}" if forwards
                         else "-"])
    second = markdown_table(
        ["work", "GFLOP (useful)", "seconds", "GFLOP/s", "weight matrices read GB/s "
         "(decode: each forward reads every matrix once)"], achieved)
    linear, per_key = linear_flops_per_row(config), attention_flops_per_key(config)
    return (f"{first}\n\n{second}\n\nFLOPs per token of the {plan['preset']} decoder: "
            f"{linear / 1e6:.1f} MFLOP in the linear layers and lm_head, plus "
            f"{per_key / 1e3:.1f} kFLOP per key attended ({per_key * 512 / 1e6:.1f} MFLOP at "
            f"512 keys); weight matrices {weights / 2**20:.0f} MiB (fp32)")
