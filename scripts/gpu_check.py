"""The CUDA path, checked on one GPU; every run ends with a verdict table.

Prints the environment first (ONNX Runtime version and build, providers, what
`onnxruntime.preload_dlls()` printed, the libcudart loaded, the GPU's name, driver and memory;
a failed CUDA probe is run again with its stderr visible), builds the reference decoder twice
from one seed (float16 for the device: CUDA's GroupQueryAttention has no float32 kernel;
float32 for the CPU), then runs and checks:

- CPU float32 against the device float16: first tokens (near ties excused) and last-row logits
  within FP16_LOGITS_RTOL of the largest logit;
- graphs off against graphs on: tokens, max logits difference, decode speed ratio;
- per variant, the nodes ONNX Runtime placed (`session.record_ep_graph_assignment_info`): no
  CPU node but shape arithmetic, no Memcpy;
- one session per model: `stats.sessions` and `stats.weights_copies` are 1 after every width
  and the batch of 8 ran;
- captures: one per key (width, batch and slot; per graph id) in pass 1, none in pass 2, counted
  by the runtime and from ONNX Runtime's own log lines (a capture is the first user run under
  its id, which also logs its warm-up runs as "Start another run"); the widths that captured
  equal the widths used where capture pays (decode and the ladder tiers);
- device memory: the bytes after load and a first forward within WEIGHTS_KV_RTOL of weights +
  KV; flat while new widths arrive in pass 1 (less than half a weights copy added, the
  graphs' own bytes reported beside); after pass 2 flat within FLAT_BYTES of pass 1; after
  close back within CLOSE_SLACK_BYTES of the baseline (device memory is cudaMemGetInfo's, never
  the runtime's own counters); a second sequence (its TTFT; it reuses the first one's pooled
  buffers, so it captures nothing); a run of two sequences at once whose graphs stay within the
  plan made at load (never evicted: the CUDA provider frees graphs only with the session);
- the engine at batch 8: its batched decode captured and replayed, its tokens equal to the
  engine's with graphs off;
- weights: the copies the runtime holds (one), and the experiment that says whether per-width
  sessions (`specialize=True`) given device buffers ONNX Runtime does not own
  (`OrtValue.from_dlpack`) would share one copy;
- a folder converted for native chunks where ONNX Runtime has them (wired as 1.32 wires
  query_seqlens): it loads on this ONNX Runtime and gives the unwired folder's greedy tokens
  (natively where this ONNX Runtime has the input, else without it: "repeat").

Each step is caught: a failure becomes one error row and the rest still runs (a failed import
is the table's one "import" row; a failed node-placement reading is the placement row). Rows
are printed and written to table.txt and results.json as they come, and the table is printed
last.
`--dry-run` runs all of it on CPU (the CPU device marked not host-visible standing in for
CUDA, its session marked capturing so the graph bookkeeping runs; memory is the resident set
and is reported, not judged). Exit status 1 when a check fails.

    python3 scripts/gpu_check.py [--dry-run] [--preset bench] [--out DIR]
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

# What the check needs beyond the standard library; a failure here (onnxruntime-gpu that cannot
# load its CUDA libraries, a missing package) still ends with the table: one "import" row.
try:
    import click
    import numpy as np
    import onnxruntime as ort

    import onnx_chunk
    from onnx_chunk.ladder import DECODE_WIDTH
    from onnx_chunk.models import build_decoder
    from onnx_chunk.runtime import Device, GenerationStats, MaskPolicy, SequenceStats, debug
    IMPORT_ERROR = None
except Exception as error:  # any import failure becomes the table's one row
    IMPORT_ERROR = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"

MIB = 1 << 20
# float16 device logits against float32 CPU logits: allowed |diff| as a fraction of the largest
# |logit| (float16 keeps 11 significant bits, 4.9e-4 relative; several layers of rounding add up).
FP16_LOGITS_RTOL = 1e-2
# Graphs on against off: the same kernels replayed, so only noise is allowed.
GRAPH_LOGITS_RTOL = 1e-3
FLAT_BYTES = 2 * MIB
# Device bytes after load and a first forward against the weights plus the KV buffers.
WEIGHTS_KV_RTOL = 0.10
ENGINE_BATCH = 8
CLOSE_SLACK_BYTES = 64 * MIB
DEVICE_DTYPE = "float16"
CPU_DTYPE = "float32"
TABLE_NAME_WIDTH = 30  # gpu_check.sh appends its cache-thrash row at the same width
ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"
CAPTURE_LINE = "capturing the cuda graph"
# InferenceSession::Run's line before each run it adds to reach a capture
# (onnxruntime/core/session/inference_session.cc): warm-ups and the capture, all in one user run.
RERUN_LINE = "start another run for necessary memory allocation or graph capture"
COPIED_INITIALIZER_LINE = "cannot use user supplied initializer"
INFO_SEVERITY = 1
WARNING_SEVERITY = 2
# Nodes ONNX Runtime may keep on the CPU beside a CUDA graph: shape arithmetic on small int64
# tensors. Anything else on the CPU is compute that leaves the device.
SHAPE_OPS = frozenset({"Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice",
                       "Cast", "Reshape", "ConstantOfShape", "Range", "Equal", "Where",
                       "ReduceSum", "Sub", "Add", "Mul", "Div", "Expand", "Min", "Max"})
MEMCPY_OPS = frozenset({"MemcpyFromHost", "MemcpyToHost"})


class _Report:
    """Rows printed and saved as they come; a failing step becomes one error row."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[tuple[str, str, str]] = []
        self.results: dict = {}

    def add(self, name: str, verdict: str, detail: str) -> None:
        self.rows.append((name, verdict, detail))
        click.echo(f"row: {name} | {verdict} | {detail}")
        sys.stdout.flush()
        self.save()

    def judge(self, name: str, passed: bool | None, detail: str) -> None:
        self.add(name, "info" if passed is None else ("ok" if passed else "FAIL"), detail)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        click.echo(f"== {name}")
        try:
            yield
        except Exception as error:  # each step's failure is reported and the rest still runs
            message = " ".join(str(error).split())[:300]
            self.add(f"error: {name}", "FAIL", f"{type(error).__name__}: {message}")
            click.echo(f"error: {name}: {type(error).__name__}: {message}", err=True)
        finally:
            click.echo(f"   ({time.perf_counter() - began:.1f} s)")

    def table(self) -> str:
        width = max(TABLE_NAME_WIDTH, *(len(name) for name, _, _ in self.rows))
        lines = [f"{'check':<{width}}  {'result':<6}  detail"]
        lines += [f"{name:<{width}}  {verdict:<6}  {detail}" for name, verdict, detail in
                  self.rows]
        return "\n".join(lines)

    def save(self) -> None:
        _write(self.out / "table.txt", self.table() + "\n")
        _write(self.out / "results.json", json.dumps(self.results, indent=2, default=str))

    @property
    def failed(self) -> bool:
        return any(verdict == "FAIL" for _, verdict, _ in self.rows)


@dataclass
class Run:
    """One runtime's results over the prompts: two passes, a second sequence, a close."""

    label: str
    dtype: str = ""
    tokens: list[list[int]] = field(default_factory=list)
    second_pass: list[list[int]] = field(default_factory=list)
    prompt_logits: list[np.ndarray] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_tokens_per_s: float | None = None
    second_ttft_s: float = 0.0
    widths_used: set[int] = field(default_factory=set)
    graph_widths: tuple[int, ...] = ()
    captures: list[dict[int, int]] = field(default_factory=list)  # per pass, by width
    capture_lines: list[int] = field(default_factory=list)  # pass 1, pass 2, second sequence
    rerun_lines: list[int] = field(default_factory=list)  # "Start another run", per pass
    second_captures: int = 0
    ids_per_slot: int = 1
    fallbacks: dict = field(default_factory=dict)
    memory: dict[str, int | None] = field(default_factory=dict)
    variant_bytes: dict = field(default_factory=dict)
    evictions: int = 0
    graphs: dict = field(default_factory=dict)
    capture_widths: set[int] = field(default_factory=set)
    sessions: int = 0
    weights_copies: int = 0
    kv_bytes: int = 0
    weights_bytes: int = 0
    meter: str = ""
    placement: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"dtype": self.dtype, "tokens": self.tokens, "ttft_s": self.ttft_s,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "second_ttft_s": self.second_ttft_s, "widths_used": sorted(self.widths_used),
                "graph_widths": list(self.graph_widths), "captures": self.captures,
                "capture_lines": self.capture_lines, "rerun_lines": self.rerun_lines,
                "second_captures": self.second_captures,
                "fallbacks": self.fallbacks, "memory": self.memory,
                "variant_bytes": {str(k): v for k, v in self.variant_bytes.items()},
                "evictions": self.evictions, "graphs": self.graphs,
                "sessions": self.sessions, "weights_copies": self.weights_copies,
                "kv_bytes": self.kv_bytes, "placement": self.placement}


def _prompts(chunk: int, capacity: int, new_tokens: int, vocab: int) -> list[np.ndarray]:
    # Remainders of 3, 5 and 7 rows all land in the smallest ladder tier, so every width used
    # runs twice on its binding in pass 1 and captures there (the binding's first run learns
    # its shapes under -1; the next one, the first under its graph id, is the capture).
    lengths = (3, chunk - 1, chunk + 1, 2 * chunk + 5, 5 * chunk + 7)
    room = capacity - new_tokens
    return [np.random.default_rng(length).integers(0, vocab, min(length, room))
            for length in lengths]


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[Path]:
    """File descriptor 2 (where ONNX Runtime logs) written to `path` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("wb") as target:
        os.dup2(target.fileno(), 2)
        try:
            yield path
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _count_lines(path: Path, needle: str) -> int:
    return sum(needle in line.lower() for line in path.read_text(errors="replace").splitlines())


@contextlib.contextmanager
def _marked_capturing(enabled: bool) -> Iterator[None]:
    """The dry run's stand-in: a CPU session asked to capture counts as capturing graphs."""
    with debug.sessions_count_as_capturing() if enabled else contextlib.nullcontext():
        yield


def _last_generation(stats: SequenceStats) -> GenerationStats:
    """The generation a sequence's `stats` end with: every `generate` records one."""
    assert stats.last_generation is not None, "generate() records its generation"
    return stats.last_generation


class _RunOptions(TypedDict, total=False):
    """The keyword options of `_run`."""

    stand_in: bool
    max_variants: int | None
    padding: bool | None
    passes: int
    overlap: bool


def _run(label: str, model: Path, device: Device, prompts, args, logs: Path, *,
         stand_in: bool = False, max_variants: int | None = None, padding: bool | None = None,
         passes: int = 2, overlap: bool = False) -> Run:
    """`overlap`: the second sequence runs while the first is open (another slot, so other
    buffers and graphs), else after it closed (its pooled slot, replaying its graphs)."""
    meter = debug.meter_for(device.device_type, device.device_id)
    record = Run(label, meter=meter.name)
    memory = record.memory
    memory["baseline"] = meter.used_bytes()
    with _marked_capturing(stand_in):
        runtime = onnx_chunk.load(model, device=device, capacity=args["capacity"],
                                  chunk_size=args["chunk_size"], max_variants=max_variants,
                                  padding=padding)
        runtime.debug.variants.factory.log_severity = INFO_SEVERITY
        # The session load built logs at the factory's default severity: built again at INFO,
        # so that ONNX Runtime's capture lines are in the logs.
        runtime.debug.cache.clear()
        record.weights_bytes = runtime.debug.weights.nbytes
        record.ids_per_slot = 2 if runtime.debug.ports.state else 1
        sequence = runtime.open_sequence()
        # The session is built by the first forward: "after load" is the weights, the KV
        # buffers and one decode-width forward's arena.
        sequence.prefill(prompts[0][:1])
        record.kv_bytes = sequence.stats.kv_bytes
        memory["after load"] = meter.used_bytes()
        slug = label.replace(" ", "-")
        for number in range(1, passes + 1):
            before = dict(runtime.stats.graphs_by_width)
            with _stderr_to(logs / f"{slug}-pass{number}.log") as log:
                for ids in prompts:
                    sequence.rewind(sequence.length)
                    if number == 1:
                        record.prompt_logits.append(sequence.prefill(ids).astype(np.float32))
                        sequence.rewind(sequence.length)
                    tokens = sequence.generate(ids, args["new_tokens"])
                    (record.tokens if number == 1 else record.second_pass).append(tokens)
                    generation = _last_generation(sequence.stats)
                    record.widths_used |= {chunk.width for chunk in generation.chunks}
                    if len(tokens) > 1:
                        record.widths_used.add(DECODE_WIDTH)
            record.capture_lines.append(_count_lines(log, CAPTURE_LINE))
            record.rerun_lines.append(_count_lines(log, RERUN_LINE))
            after = runtime.stats.graphs_by_width
            record.captures.append({width: count - before.get(width, 0)
                                    for width, count in after.items()
                                    if count != before.get(width, 0)})
            memory[f"after pass {number}"] = meter.used_bytes()
        record.ttft_s = generation.ttft_s
        record.decode_tokens_per_s = generation.decode_tokens_per_s
        if not overlap:
            sequence.close()
        captured = runtime.stats.graphs_captured
        with runtime.open_sequence() as second, \
                _stderr_to(logs / f"{slug}-second-sequence.log") as log:
            second.generate(prompts[-1], args["new_tokens"])
            record.second_ttft_s = _last_generation(second.stats).ttft_s
        record.capture_lines.append(_count_lines(log, CAPTURE_LINE))
        sequence.close()
        stats = runtime.stats
        record.second_captures = stats.graphs_captured - captured
        record.graph_widths = stats.graph_widths
        record.capture_widths = {width for width in record.widths_used
                                 if width == DECODE_WIDTH or width in runtime.stats.ladder}
        record.fallbacks = dict(stats.graph_fallbacks)
        record.variant_bytes = dict(stats.cache.variant_bytes)
        record.evictions = stats.cache.evictions + stats.graphs.evictions
        record.graphs = dataclasses.asdict(stats.graphs)
        record.sessions, record.weights_copies = stats.sessions, stats.weights_copies
        options = runtime.debug.options
        keys = {debug.variant_key(width, options.tiers, options.specialize)
                for width in record.widths_used}
        factory, weights = runtime.debug.factory, runtime.debug.weights
        select_rows = runtime.debug.variants.select_rows
        runtime.close()
        del runtime, sequence, second
        memory["after close"] = meter.used_bytes()
        try:
            record.placement = _placement(factory, weights, keys, select_rows)
        except Exception as error:  # placement has a row of its own, with the reason
            record.placement = {"error": f"{type(error).__name__}: "
                                         f"{' '.join(str(error).split())[:300]}"}
    return record


def _placement(factory: debug.SessionFactory, weights: debug.SharedWeights, keys,
               select_rows: bool) -> dict:
    """Per variant (built as the runtime builds it): nodes per provider, the op types placed
    off the device's provider and the Memcpy nodes."""
    recording = debug.SessionFactory(factory.model_path, weights, factory.device,
                                     query_dim=factory.query_dim, fixed_dims=factory.fixed_dims,
                                     session_config={ASSIGNMENT_KEY: "1"})
    device_ep = factory.device.session_providers[0][0]
    placement = {}
    for key in sorted(keys, key=lambda k: (k is None, k or 0)):
        session = recording.create(key, prepack=False,
                                   last_row=select_rows and key != DECODE_WIDTH)
        per_provider: dict[str, int] = {}
        cpu_ops: dict[str, int] = {}
        memcpy = 0
        for subgraph in session.get_provider_graph_assignment_info():
            for node in subgraph.get_nodes():
                per_provider[subgraph.ep_name] = per_provider.get(subgraph.ep_name, 0) + 1
                memcpy += node.op_type in MEMCPY_OPS
                if subgraph.ep_name != device_ep:
                    cpu_ops[node.op_type] = cpu_ops.get(node.op_type, 0) + 1
        placement["dynamic" if key is None else str(key)] = {
            "providers": per_provider, "off_device_ops": cpu_ops, "memcpy": memcpy}
        del session
    return placement


def parity(cpu: Run, device: Run) -> tuple[bool, str]:
    """CPU float32 against device float16: first tokens (near ties excused) and logits."""
    count = len(cpu.tokens)
    scale = max(float(np.abs(logits).max()) for logits in cpu.prompt_logits)
    allowed = FP16_LOGITS_RTOL * max(scale, 1.0)
    diff = _max_diff(cpu, device)
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


def _max_diff(a: Run, b: Run) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a.prompt_logits, b.prompt_logits))


def _build(out: Path, preset: str, dtype: str) -> Path:
    folder = out / f"model-{preset}-{dtype}"
    model = folder / "model.onnx"
    if not model.is_file():
        build_decoder(folder, preset=preset, dtype=dtype)
    return model


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def _delta(memory: dict, later: str, earlier: str) -> int | None:
    if memory.get(later) is None or memory.get(earlier) is None:
        return None
    return memory[later] - memory[earlier]


def _environment(report: _Report, device_id: int, dry_run: bool) -> None:
    printed = io.StringIO()
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        preloaded = "onnxruntime has no preload_dlls"
    else:
        try:
            with contextlib.redirect_stdout(printed):
                preload()
            preloaded = " ".join(printed.getvalue().split())[:200] or "ok, nothing printed"
        except Exception as error:  # reported, the probe below says whether CUDA works
            preloaded = f"failed: {error}"
    library = debug.cudart()
    build = ort.get_build_info() if hasattr(ort, "get_build_info") else "n/a"
    report.add("onnxruntime", "info", f"{ort.__version__} at {Path(ort.__file__).parent}; "
               f"{' '.join(build.split())[:160]}")
    report.add("providers", "info", ", ".join(ort.get_available_providers()))
    report.add("preload_dlls", "info", preloaded)
    report.add("libcudart", "info", "none loaded" if library is None else str(library._name))
    report.add("gpu", "info", _gpu_description(device_id))
    failure = debug.probe_cuda(device_id)
    if failure is not None:
        click.echo("the CUDA probe failed; again with ONNX Runtime's stderr visible:")
        debug.probe_cuda(device_id, quiet=False)
    report.judge("cuda probe", None if dry_run else failure is None,
                 "a CUDA session works" if failure is None else failure)


def _gpu_description(device_id: int) -> str:
    used = debug.meter_for("cuda", device_id).used_bytes()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return f"no nvidia-smi; cudaMemGetInfo used {_mib(used)}"
    try:
        answer = subprocess.run(
            [smi, f"--id={device_id}", "--query-gpu=name,driver_version,memory.total,"
             "memory.used", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi failed: {error}"
    text = answer.stdout.strip() or answer.stderr.strip()
    return f"{text[:200]}; cudaMemGetInfo used {_mib(used)}"


def _capture_rows(report: _Report, run: Run, dry_run: bool) -> None:
    specialised = run.capture_widths
    expected = {width: run.ids_per_slot for width in sorted(specialised)}
    first, second = run.captures
    report.judge("captures in pass 1", first == expected and not run.fallbacks,
                 f"by width {first}, expected {expected}"
                 f"{f'; fallbacks {run.fallbacks}' if run.fallbacks else ''}")
    report.judge("captures in pass 2", not second, f"by width {second or 'none'} (replay only)")
    total = sum(first.values())
    lines = run.capture_lines
    # A capture is the first user run under its id: ONNX Runtime logs it once, and the runs it
    # added to reach it ("Start another run") in the same user run; none in pass 2.
    reruns = run.rerun_lines
    report.judge("capture log lines", None if dry_run else (lines[:2] == [total, 0]
                                                            and reruns[1:] == [0]),
                 f"ONNX Runtime logged {lines[0]} captures in pass 1, {lines[1]} in pass 2, "
                 f"{lines[2]} for the second sequence; 'Start another run' {reruns}; the "
                 f"runtime counted {total}{' (CPU sessions log no capture)' if dry_run else ''}")
    report.judge("captured widths = widths used", set(run.graph_widths) == specialised
                 and set(first) == specialised,
                 f"captured at {list(run.graph_widths)}, used {sorted(run.widths_used)}, "
                 f"capture pays at {sorted(specialised)}")
    report.judge("second sequence", run.second_captures == 0 and lines[2] == 0,
                 f"TTFT {run.second_ttft_s * 1000:.1f} ms (first sequence "
                 f"{run.ttft_s * 1000:.1f} ms), {run.second_captures} captures (pooled buffers "
                 "replay the first sequence's graphs)")


def _load_rows(report: _Report, run: Run, dry_run: bool) -> None:
    """Device bytes after load against weights + KV; flat while new widths arrive."""
    memory = run.memory
    held = _delta(memory, "after load", "baseline")
    expected = run.weights_bytes + run.kv_bytes
    near = held is not None and abs(held - expected) <= WEIGHTS_KV_RTOL * expected
    report.judge(f"bytes after load ({run.meter})", None if dry_run else near,
                 f"{_mib(held)} against weights {_mib(run.weights_bytes)} + KV "
                 f"{_mib(run.kv_bytes)} = {_mib(expected)} (allowed "
                 f"{WEIGHTS_KV_RTOL:.0%})")
    grown = _delta(memory, "after pass 1", "after load")
    flat = grown is not None and grown < run.weights_bytes / 2
    report.judge(f"bytes as widths arrive ({run.meter})", None if dry_run else flat,
                 f"pass 1 added {_mib(grown)} over {len(run.widths_used)} widths "
                 f"(no weights copy: under {_mib(run.weights_bytes // 2)}); graphs alive "
                 f"{run.graphs.get('alive')}, measured at capture {_mib(run.graphs.get('bytes'))}")
    report.judge("one session per model", run.sessions == 1 and run.weights_copies == 1,
                 f"{run.sessions} sessions, {run.weights_copies} weights copies after "
                 f"widths {sorted(run.widths_used)}")


def _engine_rows(report: _Report, engines: dict[str, dict]) -> None:
    on, off = engines.get("graphs on"), engines.get("graphs off")
    if on is None:
        return
    graphs = on["graphs"]
    decode = graphs["by_width"].get(DECODE_WIDTH, 0)
    same = off is not None and on["tokens"] == off["tokens"]
    report.judge(f"engine at batch {ENGINE_BATCH}",
                 decode > 0 and graphs["replays"] > 0 and on["sessions"] == 1 and same,
                 f"decode captures {decode}, replays {graphs['replays']}, sessions "
                 f"{on['sessions']}, tokens {'equal' if same else 'differ from'} graphs off; "
                 f"decode rows/step {on['rows_per_step']}")


def _engine(model: Path, device: Device, prompts, args, stand_in: bool) -> dict:
    """The batch engine at ENGINE_BATCH slots over ENGINE_BATCH prompts."""
    batch = [prompts[index % len(prompts)][:args["chunk_size"] + index]
             for index in range(ENGINE_BATCH)]
    with _marked_capturing(stand_in), onnx_chunk.load(
            model, device=device, capacity=args["capacity"], chunk_size=args["chunk_size"],
            max_batch=ENGINE_BATCH, padding=True) as runtime:
        tokens = runtime.generate_many(batch, args["new_tokens"], eos_token_id=[])
        stats = runtime.stats
        assert stats.engine is not None, "a runtime with max_batch > 1 runs an engine"
        return {"tokens": tokens, "graphs": dataclasses.asdict(stats.graphs),
                "sessions": stats.sessions, "rows_per_step": stats.engine.rows_per_decode_step}


# Where ONNX Runtime 1.32's GroupQueryAttention takes query_seqlens: a folder converted there.
ORT_132_QUERY_SEQLENS_INDEX = 16


def _native_elsewhere(report: _Report, model: Path, device: Device, prompts, args,
                      work: Path) -> None:
    """The device model converted without native chunks and with them as ONNX Runtime 1.32
    wires them; both loaded on `device`, padding on: the same greedy tokens."""
    from onnx_chunk.graph.model_io import load_model, save_model
    from onnx_chunk.passes import QuerySeqlensPass, convert_model

    converted = convert_model(load_model(model), native_chunks="off").model
    save_model(converted, work / "plain" / "model.onnx", companions_from=model.parent)
    QuerySeqlensPass("on", index=ORT_132_QUERY_SEQLENS_INDEX)(converted)
    save_model(converted, work / "wired" / "model.onnx", companions_from=model.parent)
    tokens, padding = {}, {}
    for name in ("plain", "wired"):
        with onnx_chunk.load(work / name, device=device, capacity=args["capacity"],
                             chunk_size=args["chunk_size"], padding=True) as runtime:
            padding[name] = runtime.stats.padding
            tokens[name] = [runtime.submit(prompt, args["new_tokens"], eos_token_id=[]).result()
                            for prompt in prompts]
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["wired"]))
    report.judge("native folder from elsewhere", same == len(prompts),
                 f"padding {padding['wired']} (unwired: {padding['plain']}); "
                 f"{same}/{len(prompts)} prompts' tokens equal the unwired folder's")


def _memory_rows(report: _Report, run: Run, dry_run: bool, name: str) -> None:
    memory = run.memory
    back = _delta(memory, "after close", "baseline")
    checks = [back is not None and back <= CLOSE_SLACK_BYTES]
    detail = (f"after close - baseline {_mib(back)} (allowed {_mib(CLOSE_SLACK_BYTES)})")
    if "after pass 2" in memory:
        flat = _delta(memory, "after pass 2", "after pass 1")
        checks.append(flat is not None and abs(flat) <= FLAT_BYTES)
        detail = f"pass 2 - pass 1 {_mib(flat)} (allowed {_mib(FLAT_BYTES)}), {detail}"
    readings = ", ".join(f"{key} {_mib(value)}" for key, value in memory.items())
    # The resident set of a CPU stand-in says nothing about device memory: reported only.
    report.judge(f"memory {name} ({run.meter})", None if dry_run else all(checks),
                 f"{readings}; {detail}")


def _placement_row(report: _Report, run: Run) -> None:
    if "error" in run.placement:
        report.judge("node placement", False, f"could not be read: {run.placement['error']}")
        return
    bad = {}
    for variant, found in run.placement.items():
        compute = {op: n for op, n in found["off_device_ops"].items() if op not in SHAPE_OPS}
        if compute or found["memcpy"]:
            bad[variant] = {"compute off the device": compute, "memcpy": found["memcpy"]}
    summary = "; ".join(f"{variant}: {found['providers']}"
                        for variant, found in run.placement.items())
    report.judge("node placement", not bad, f"{summary}" + (f"; wrong: {bad}" if bad else ""))


def _weights_experiment(model: Path, device: Device, args, logs: Path) -> dict:
    """Two sessions given host weights (today's design) and two given device buffers that ONNX
    Runtime does not own (`OrtValue.from_dlpack` over runtime-allocated values): what each
    session adds to the device, and whether ONNX Runtime logged that it copied them."""
    meter = debug.meter_for(device.device_type, device.device_id)
    runtime = onnx_chunk.load(model, device=device, capacity=args["capacity"],
                              chunk_size=args["chunk_size"], specialize=True)
    width = runtime.stats.chunk_size
    factory = runtime.debug.factory
    host = runtime.debug.weights
    owned, views = [], []
    allocated_before = meter.used_bytes()
    for host_value in host.values:
        array = host_value.numpy()
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype.type,
                                                          device.device_type, device.device_id)
        value.update_inplace(array)
        owned.append(value)
        views.append(ort.OrtValue.from_dlpack(value))
    allocated = meter.used_bytes()
    device_weights = debug.SharedWeights(host.names, tuple(views), host.nbytes)
    result: dict[str, object] = {"weights_bytes": host.nbytes,
              "device_copy_bytes": None if allocated is None or allocated_before is None
              else allocated - allocated_before}
    for design, weights in (("host", host), ("device", device_weights)):
        sessions = debug.SessionFactory(factory.model_path, weights, device,
                                        query_dim=factory.query_dim,
                                        fixed_dims=factory.fixed_dims,
                                        log_severity=WARNING_SEVERITY)
        grown, kept = [], []
        with _stderr_to(logs / f"weights-{design}.log") as log:
            for key in (width, DECODE_WIDTH):
                before = meter.used_bytes()
                kept.append(sessions.create(key, prepack=False))
                after = meter.used_bytes()
                grown.append(None if before is None or after is None else after - before)
        result[design] = {"session_bytes": grown,
                          "copied_lines": _count_lines(log, COPIED_INITIALIZER_LINE)}
        del kept
    runtime.close()
    return result


def _weights_rows(report: _Report, run: Run, experiment: dict | None, dry_run: bool) -> None:
    weights = run.weights_bytes
    sizes = [size for size in run.variant_bytes.values() if size]
    # The design: one session per model holding one copy (docs/cuda.md); its build reading
    # (weights and arena) above two copies' worth is a regression.
    limit = 2 * weights + CLOSE_SLACK_BYTES
    report.judge("weights copies", run.weights_copies == 1 and len(sizes) <= 1
                 and all(size <= limit for size in sizes),
                 f"weights {_mib(weights)}; {run.weights_copies} copies; sessions hold "
                 f"{', '.join(f'{k}: {_mib(v)}' for k, v in run.variant_bytes.items())} "
                 f"(regression above {_mib(limit)})")
    if experiment is None:
        return
    host, device = experiment["host"], experiment["device"]
    # Against the host design's sessions, so what every session adds anyway (handles, arena)
    # cancels out: in place, a session given device buffers adds about one copy less.
    pairs = [(ours, theirs) for ours, theirs in zip(device["session_bytes"],
                                                   host["session_bytes"])
             if ours is not None and theirs is not None]
    shares = bool(pairs) and device["copied_lines"] == 0 and all(
        ours < theirs - weights / 2 for ours, theirs in pairs)
    if dry_run:
        answer = "dry run: CPU sessions use host memory in place in both designs"
    elif shares:
        answer = "sessions given device buffers use them in place: one copy holds"
    else:
        answer = "sessions given device buffers still copy them (or the reading is missing)"
    report.add("weights experiment", "info",
               f"{answer}; device copy {_mib(experiment['device_copy_bytes'])}; per session "
               f"host {', '.join(map(_mib, host['session_bytes']))} "
               f"({host['copied_lines']} 'Cannot use user supplied initializer' lines), "
               f"device {', '.join(map(_mib, device['session_bytes']))} "
               f"({device['copied_lines']} lines)")


def _import_failed(argv: list[str]) -> None:
    """The table of a run whose imports failed: one row with the reason, status 1."""
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv[:-1] else None
    table = (f"{'check':<{TABLE_NAME_WIDTH}}  result  detail\n"
             f"{'import':<{TABLE_NAME_WIDTH}}  FAIL    {IMPORT_ERROR}\n")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.txt").write_text(table)
    print(f"error: import: {IMPORT_ERROR}", file=sys.stderr)
    print("\n" + table, end="")
    sys.exit(1)


if IMPORT_ERROR is not None:
    if __name__ == "__main__":
        _import_failed(sys.argv)
    raise SystemExit(f"gpu_check: {IMPORT_ERROR}")


@click.command()
@click.option("--dry-run", is_flag=True, help="Run on CPU, the CPU device standing in for CUDA.")
@click.option("--preset", default="bench", show_default=True, help="Reference decoder preset.")
@click.option("--chunk-size", default=256, show_default=True)
@click.option("--capacity", default=2048, show_default=True)
@click.option("--new-tokens", default=16, show_default=True)
@click.option("--device-id", default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the models, results.json, table.txt and the ORT logs.")
def main(dry_run: bool, preset: str, chunk_size: int, capacity: int, new_tokens: int,
         device_id: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "ort-logs"
    logs.mkdir(exist_ok=True)
    report = _Report(out)
    try:
        _check(report, dry_run, preset, chunk_size, capacity, new_tokens, device_id, out, logs)
    finally:
        report.save()
        click.echo("\n" + report.table())
    sys.exit(1 if report.failed else 0)


def _check(report: _Report, dry_run: bool, preset: str, chunk_size: int, capacity: int,
           new_tokens: int, device_id: int, out: Path, logs: Path) -> None:
    with report.step("environment"):
        _environment(report, device_id, dry_run)
    models = {}
    with report.step("models"):
        models = {dtype: _build(out, preset, dtype) for dtype in (CPU_DTYPE, DEVICE_DTYPE)}
    if len(models) < 2:
        return
    if dry_run:
        # The CPU device dressed as CUDA: no host view, capacity-wide mask, one session.
        off = dataclasses.replace(debug.device_for("cpu"), host_visible=False,
                                  mask_policy=MaskPolicy.CAPACITY)
        on = dataclasses.replace(off, cuda_graphs=True)
    else:
        off = debug.device_for("cuda", device_id, cuda_graphs=False)
        on = debug.device_for("cuda", device_id, cuda_graphs=True)
    args = {"capacity": capacity, "chunk_size": chunk_size, "new_tokens": new_tokens}
    with onnx_chunk.load(models[CPU_DTYPE], device=debug.device_for("cpu"), capacity=capacity,
                         chunk_size=chunk_size) as probe:
        prompts = _prompts(probe.stats.chunk_size, probe.stats.capacity, new_tokens,
                           probe.stats.vocab_size)
    report.add("setup", "info", f"{on.label}{', dry run on CPU' if dry_run else ''}; preset "
               f"{preset}; prompts {[len(p) for p in prompts]}, W={chunk_size}, capacity "
               f"{capacity}, {new_tokens} new tokens")
    runs: dict[str, Run] = {}
    # Padding on in both device runs, so graphs off and on run the same widths and kernels.
    plan: tuple[tuple[str, Device, str, _RunOptions], ...] = (
        ("cpu", debug.device_for("cpu"), CPU_DTYPE, {}),
            ("graphs off", off, DEVICE_DTYPE, {"padding": True}),
            ("graphs on", on, DEVICE_DTYPE, {"stand_in": dry_run}),
            # Two sequences open at once, padding off: graphs stay within the plan made at
            # load (never evicted: the CUDA provider frees them only with the session); the
            # second sequence's shapes whose keys are held, and the remainders, run uncaptured.
            ("plan", on, DEVICE_DTYPE, {"stand_in": dry_run, "padding": False, "passes": 1,
                                        "overlap": True}))
    for label, device, dtype, options in plan:
        with report.step(f"run {label}"):
            began = time.perf_counter()
            runs[label] = _run(label, models[dtype], device, prompts, args, logs, **options)
            runs[label].dtype = dtype
            report.results[label] = runs[label].summary()
            click.echo(f"{label}: {device.label}, {dtype} in {time.perf_counter() - began:.1f} s")
    engines: dict[str, dict] = {}
    for label, device, stand_in in (("graphs off", off, False), ("graphs on", on, dry_run)):
        with report.step(f"engine {label}"):
            engines[label] = _engine(models[DEVICE_DTYPE], device, prompts, args, stand_in)
            report.results[f"engine {label}"] = engines[label]
    cpu, graphs_off, graphs_on = runs.get("cpu"), runs.get("graphs off"), runs.get("graphs on")
    with report.step("compare cpu and device"):
        if cpu and graphs_off:
            report.judge("greedy tokens cpu vs device", *parity(cpu, graphs_off))
    with report.step("compare graphs off and on"):
        if graphs_off and graphs_on:
            scale = max(float(np.abs(logits).max()) for logits in graphs_off.prompt_logits)
            diff = _max_diff(graphs_off, graphs_on)
            same = sum(a == b for a, b in zip(graphs_off.tokens, graphs_on.tokens))
            ratio = (None if not graphs_off.decode_tokens_per_s
                     or graphs_on.decode_tokens_per_s is None
                     else graphs_on.decode_tokens_per_s / graphs_off.decode_tokens_per_s)
            report.judge("graphs off vs on", diff <= GRAPH_LOGITS_RTOL * max(scale, 1.0),
                         f"logits max |diff| {diff:.2e} (allowed {GRAPH_LOGITS_RTOL:g} of "
                         f"{scale:.2f}); {same}/{len(prompts)} prompts' tokens identical; "
                         f"decode on/off {'n/a' if ratio is None else f'{ratio:.2f}x'}")
    with report.step("replay"):
        replay = all(run.tokens == run.second_pass for label, run in runs.items()
                     if label != "plan")
        report.judge("second pass (replay) vs first", replay,
                     "tokens identical in every run" if replay else "tokens differ")
    for run in (graphs_off, graphs_on):
        if run is not None:
            tps = ("n/a" if run.decode_tokens_per_s is None
                   else f"{run.decode_tokens_per_s:.1f} tokens/s")
            report.add(f"TTFT / decode, {run.label}", "info",
                       f"prompt {len(prompts[-1])}: TTFT {run.ttft_s * 1000:.1f} ms, "
                       f"decode {tps}")
    if graphs_on is not None:
        with report.step("captures"):
            _capture_rows(report, graphs_on, dry_run)
        with report.step("placement"):
            _placement_row(report, graphs_on)
        with report.step("memory"):
            _load_rows(report, graphs_on, dry_run)
            _memory_rows(report, graphs_on, dry_run, "graphs on")
    with report.step("engine"):
        _engine_rows(report, engines)
    with report.step("native folder from elsewhere"):
        _native_elsewhere(report, models[DEVICE_DTYPE], off, prompts, args, out / "native")
    planned = runs.get("plan")
    if planned is not None:
        with report.step("plan"):
            # Remainders run unpadded on another kernel: float16 logits differ by tiling.
            scale = max(float(np.abs(logits).max()) for logits in planned.prompt_logits)
            diff = _max_diff(planned, graphs_on) if graphs_on is not None else float("inf")
            allowed = FP16_LOGITS_RTOL * max(scale, 1.0)
            graphs = planned.graphs
            peak, bound = graphs.get("peak_alive", 0), graphs.get("planned", 0)
            report.judge("graphs within the plan",
                         planned.evictions == 0 and peak <= bound and diff <= allowed,
                         f"at most {peak} graphs alive of {bound} planned, "
                         f"{graphs.get('outside_plan', 0)} bindings uncaptured, "
                         f"{planned.evictions} evictions; logits max |diff| against graphs on "
                         f"{diff:.2e} (allowed {allowed:.2e})")
            _memory_rows(report, planned, dry_run, "plan")
    experiment = None
    with report.step("weights experiment"):
        experiment = _weights_experiment(models[DEVICE_DTYPE], on, args, logs)
        report.results["weights experiment"] = experiment
    if graphs_on is not None:
        with report.step("weights"):
            _weights_rows(report, graphs_on, experiment, dry_run)


def _write(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as partial:
        partial.write(text)
    Path(partial.name).replace(path)


if __name__ == "__main__":
    main()
