"""The CUDA path, checked on one GPU: parity with CPU, CUDA graphs on and off, device memory.

Builds the reference decoder twice from one seed, float16 for the device (CUDA's
GroupQueryAttention kernel has no float32 version; a float32 decoder's attention would fall
back to the CPU provider) and float32 for the CPU, runs the same prompts greedily on the CPU
provider and on the device twice (CUDA graphs off, then on), and prints one table last:

- greedy tokens: CPU (float32) against the device (float16): every prompt's first token equal
  unless the CPU's top two logits lie within the float16 tolerance (a near tie, counted), and
  every prompt's last-row logits within FP16_LOGITS_RTOL of the largest logit; graphs off
  against graphs on (the same kernels, so the same tokens), and a second pass against the
  first (the second replays the captured graphs);
- time to first token and decode tokens/s of the longest prompt, graphs off and on (second
  pass, every variant built and captured);
- the variants that capture a graph (none is a failure, also printed as an error line), the
  device memory each variant's build took and what the first pass added (activations,
  graphs), and whether the weights are held once: the memory the runtime holds beyond one
  copy of the weights stays below one more copy.

`--dry-run` runs the same on CPU: the "device" is the CPU marked not host-visible with the
capacity-wide mask (the device-memory code path of CUDA) running the float16 decoder, graphs
stay off, memory is the resident set and the weights check is reported, not judged. Exit
status 1 when a check fails.

    python3 scripts/gpu_check.py [--dry-run] [--preset bench] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort

import onnx_chunk
from onnx_chunk.models import build_decoder
from onnx_chunk.runtime.memory import meter_for
from onnx_chunk.runtime.provider import Device, MaskPolicy, device_for, resolve_device

MIB = 1 << 20
# float16 device logits against float32 CPU logits: allowed |diff| as a fraction of the largest
# |logit| (float16 keeps 11 significant bits, 4.9e-4 relative; several layers of rounding add up).
FP16_LOGITS_RTOL = 1e-2
DEVICE_DTYPE = "float16"
CPU_DTYPE = "float32"
TABLE_NAME_WIDTH = 30  # gpu_check.sh appends its cache-thrash row at the same width


@dataclass
class _Run:
    """One runtime's results over the prompts, in two passes."""

    label: str
    tokens: list[list[int]] = field(default_factory=list)
    second_pass: list[list[int]] = field(default_factory=list)
    prompt_logits: list[np.ndarray] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_tokens_per_s: float | None = None
    graph_widths: tuple[int, ...] = ()
    variant_bytes: dict = field(default_factory=dict)
    load_bytes: int | None = None
    first_pass_bytes: int | None = None
    weights_bytes: int = 0
    meter: str = ""


def _prompts(chunk: int, capacity: int, new_tokens: int, vocab: int) -> list[np.ndarray]:
    lengths = (3, chunk - 1, chunk + 1, 2 * chunk + 13, 5 * chunk + 7)
    room = capacity - new_tokens
    return [np.random.default_rng(length).integers(0, vocab, min(length, room))
            for length in lengths]


def _run(label: str, model: Path, device: Device, prompts, args, meter) -> _Run:
    record = _Run(label)
    before = meter.used_bytes()
    runtime = onnx_chunk.load(model, device=device, capacity=args["capacity"],
                              chunk_size=args["chunk_size"])
    loaded = meter.used_bytes()
    record.weights_bytes = runtime.weights.nbytes
    record.meter = meter.name
    if before is not None and loaded is not None:
        record.load_bytes = loaded - before
    sequence = runtime.open_sequence()
    for ids in prompts:
        sequence.rewind(sequence.length)
        record.prompt_logits.append(sequence.prefill(ids).astype(np.float32))
        sequence.rewind(sequence.length)
        record.tokens.append(sequence.generate(ids, args["new_tokens"]))
    after_first = meter.used_bytes()
    if loaded is not None and after_first is not None:
        record.first_pass_bytes = after_first - loaded
    for ids in prompts:
        sequence.rewind(sequence.length)
        record.second_pass.append(sequence.generate(ids, args["new_tokens"]))
    generation = sequence.stats.last_generation
    record.ttft_s = generation.ttft_s
    record.decode_tokens_per_s = generation.decode_tokens_per_s
    stats = runtime.stats()
    record.graph_widths = stats.graph_widths
    record.variant_bytes = dict(stats.cache.variant_bytes)
    return record


def _parity(cpu: _Run, device: _Run) -> tuple[bool, str]:
    """CPU float32 against device float16: first tokens (near ties excused) and logits."""
    count = len(cpu.tokens)
    scale = max(float(np.abs(logits).max()) for logits in cpu.prompt_logits)
    allowed = FP16_LOGITS_RTOL * max(scale, 1.0)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(cpu.prompt_logits,
                                                           device.prompt_logits))
    same = sum(a == b for a, b in zip(cpu.tokens, device.tokens))
    first = ties = 0
    for logits, ours, theirs in zip(cpu.prompt_logits, cpu.tokens, device.tokens):
        if ours[0] == theirs[0]:
            first += 1
        else:
            top_two = np.sort(logits)[-2:]
            ties += bool(top_two[1] - top_two[0] <= 2 * allowed)
    passed = first + ties == count and diff <= allowed
    detail = (f"{same}/{count} prompts identical, first tokens {first}/{count}"
              f"{f' ({ties} near ties)' if ties else ''}, prompt logits max |diff| {diff:.2e} "
              f"(scale {scale:.2f}, allowed {allowed:.2e}, {CPU_DTYPE} vs {DEVICE_DTYPE})")
    return passed, detail


def _build(out: Path, preset: str, dtype: str) -> Path:
    folder = out / f"model-{preset}-{dtype}"
    model = folder / "model.onnx"
    if not model.is_file():
        build_decoder(folder, preset=preset, dtype=dtype)
    return model


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def _table(rows: list[tuple[str, str, str]]) -> str:
    width = max(TABLE_NAME_WIDTH, *(len(name) for name, _, _ in rows))
    lines = [f"{'check':<{width}}  {'result':<6}  detail"]
    lines += [f"{name:<{width}}  {verdict:<6}  {detail}" for name, verdict, detail in rows]
    return "\n".join(lines)


def _judge(passed: bool | None) -> str:
    return "info" if passed is None else ("ok" if passed else "FAIL")


@click.command()
@click.option("--dry-run", is_flag=True, help="Run on CPU, the CPU device standing in for CUDA.")
@click.option("--preset", default="bench", show_default=True, help="Reference decoder preset.")
@click.option("--chunk-size", default=256, show_default=True)
@click.option("--capacity", default=2048, show_default=True)
@click.option("--new-tokens", default=16, show_default=True)
@click.option("--device-id", default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the model, results.json and table.txt.")
def main(dry_run: bool, preset: str, chunk_size: int, capacity: int, new_tokens: int,
         device_id: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    models = {dtype: _build(out, preset, dtype) for dtype in (CPU_DTYPE, DEVICE_DTYPE)}
    click.echo(f"models {', '.join(map(str, models.values()))} ({preset}, one seed) in "
               f"{time.perf_counter() - began:.1f} s; "
               f"onnxruntime {ort.__version__} at {Path(ort.__file__).parent}")
    if dry_run:
        # The CPU device dressed as CUDA: no host view, capacity-wide mask, per-width variants.
        off = dataclasses.replace(device_for("cpu"), host_visible=False,
                                  mask_policy=MaskPolicy.CAPACITY, specialize=True)
        on = off
    else:
        off = resolve_device("cuda", device_id, cuda_graphs=False)
        on = resolve_device("cuda", device_id, cuda_graphs=True)
    args = {"capacity": capacity, "chunk_size": chunk_size, "new_tokens": new_tokens}
    cpu_device = device_for("cpu")
    probe = onnx_chunk.load(models[CPU_DTYPE], device=cpu_device, capacity=capacity,
                            chunk_size=chunk_size)
    prompts = _prompts(probe.chunk_size, probe.capacity, new_tokens, probe.ports.vocab_size)
    del probe
    runs = {}
    plan = (("cpu", cpu_device, CPU_DTYPE), ("graphs off", off, DEVICE_DTYPE),
            ("graphs on", on, DEVICE_DTYPE))
    for label, device, dtype in plan:
        began = time.perf_counter()
        runs[label] = _run(label, models[dtype], device, prompts, args,
                           meter_for(device.device_type, device.device_id))
        click.echo(f"{label}: {device.label}, {dtype}, {len(prompts)} prompts x 2 passes in "
                   f"{time.perf_counter() - began:.1f} s")
    cpu, graphs_off, graphs_on = runs["cpu"], runs["graphs off"], runs["graphs on"]
    rows = [("provider", "info", f"{off.label} (onnxruntime {ort.__version__}"
             f"{', dry run on CPU' if dry_run else ''}); prompts "
             f"{[len(p) for p in prompts]}, W={chunk_size}, capacity {capacity}")]
    passed, detail = _parity(cpu, graphs_off)
    rows.append(("greedy tokens cpu vs device", _judge(passed), detail))
    rows.append(("greedy tokens graphs off vs on", _judge(graphs_off.tokens == graphs_on.tokens),
                 f"{sum(a == b for a, b in zip(graphs_off.tokens, graphs_on.tokens))}/"
                 f"{len(prompts)} prompts identical"))
    replay = all(run.tokens == run.second_pass for run in runs.values())
    rows.append(("second pass (replay) vs first", _judge(replay),
                 "tokens identical in every run" if replay else "tokens differ"))
    for run in (graphs_off, graphs_on):
        tps = ("n/a" if run.decode_tokens_per_s is None
               else f"{run.decode_tokens_per_s:.1f} tokens/s")
        rows.append((f"TTFT / decode, {run.label}", "info",
                     f"prompt {len(prompts[-1])}: TTFT {run.ttft_s * 1000:.1f} ms, "
                     f"decode {tps}"))
    if not dry_run:
        captured = bool(graphs_on.graph_widths)
        rows.append(("variants capturing CUDA graphs", _judge(captured),
                     f"widths {list(graphs_on.graph_widths)}" if captured else
                     "none: the graphs-on run captured no CUDA graph"))
        if not captured:
            click.echo("error: CUDA graphs were on but runtime.stats().graph_widths is empty: "
                       "no variant captured a graph, so the graphs-on numbers measure nothing; "
                       "see the log above for the capture failure", err=True)
    per_variant = ", ".join(f"{key}: {_mib(size)}" for key, size in
                            graphs_on.variant_bytes.items())
    rows.append((f"memory per variant ({graphs_on.meter})", "info",
                 f"builds {per_variant}; first pass added {_mib(graphs_on.first_pass_bytes)}"))
    weights = graphs_on.weights_bytes
    held = None
    if graphs_on.load_bytes is not None and graphs_on.first_pass_bytes is not None:
        beyond = graphs_on.load_bytes + graphs_on.first_pass_bytes - weights
        held = None if dry_run else beyond < weights
        detail = (f"weights {_mib(weights)}; runtime holds {_mib(beyond)} beyond one copy "
                  f"with {len(graphs_on.variant_bytes)} variants live")
    else:
        detail = f"weights {_mib(weights)}; no memory reading on this machine"
    rows.append(("weights held once", _judge(held), detail))
    table = _table(rows)
    dtypes = {"cpu": CPU_DTYPE, "graphs off": DEVICE_DTYPE, "graphs on": DEVICE_DTYPE}
    results = {label: {"dtype": dtypes[label], "tokens": run.tokens, "ttft_s": run.ttft_s,
                       "decode_tokens_per_s": run.decode_tokens_per_s,
                       "graph_widths": list(run.graph_widths),
                       "variant_bytes": {str(k): v for k, v in run.variant_bytes.items()},
                       "load_bytes": run.load_bytes, "first_pass_bytes": run.first_pass_bytes}
               for label, run in runs.items()}
    _write(out / "results.json", json.dumps(results, indent=2))
    _write(out / "table.txt", table + "\n")
    click.echo("\n" + table)
    sys.exit(1 if any(verdict == "FAIL" for _, verdict, _ in rows) else 0)


def _write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


if __name__ == "__main__":
    main()
