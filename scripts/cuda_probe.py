"""What only a GPU can settle about ONNX Runtime's CUDA graphs, in one table (run it first).

Bench decoder, float16, under 3 minutes on one GPU: captures and "Start another run" lines per
user run; replayed vs uncaptured logits; a rerun after release_captured_graph; a run from another
thread; cudaMemGetInfo around KV, 50 captures and close; Memcpy nodes; decode tokens/s graphs
on/off. `--dry-run`: the same on CPU (reported, not judged). Exit 1 when a row fails. A probe of
each forward (its capture, its logits), it feeds Sequence.prefill/decode its own greedy tokens."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROWS: list[tuple[str, str, str]] = []
try:
    import numpy as np
    import onnxruntime as ort

    import onnx_chunk
    from onnx_chunk.models import build_decoder
    from onnx_chunk.runtime import MaskPolicy, debug
    IMPORT_ERROR = None
except Exception as error:  # the table's one row
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

# The CUDA provider's line per capture; InferenceSession::Run's per run it adds to reach one.
CAPTURE_LINE = "capturing the cuda graph"
RERUN_LINE, MIB = "start another run for necessary memory allocation or graph capture", 1 << 20


def row(name: str, verdict: str | bool | None, detail: str) -> None:
    ROWS.append((name, verdict := {True: "ok", False: "FAIL", None: "info"}.get(
        verdict, verdict), detail))  # type: ignore[arg-type]
    print(f"row: {name} | {verdict} | {detail}", flush=True)


reason = lambda error: f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"  # noqa: E731


@contextlib.contextmanager
def step(name: str):
    try:
        yield
    except Exception as error:  # each step's failure is one row; the rest still runs
        row(f"error: {name}", "FAIL", reason(error))


@contextlib.contextmanager
def ort_log(lines: list[tuple[int, int]]):
    """ONNX Runtime's log (fd 2) for the block; appends (capture lines, rerun lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            text = os.pread(log.fileno(), 1 << 26, 0).decode(errors="replace").lower()
            lines.append((text.count(CAPTURE_LINE), text.count(RERUN_LINE)))


def mib(later: int | None, earlier: int | None = 0) -> str:
    return "n/a" if later is None or earlier is None else f"{(later - earlier) / MIB:.1f} MiB"


def probe(args: argparse.Namespace) -> None:
    dry = args.dry_run
    has = [name for owner, name in ((ort.InferenceSession, "release_captured_graph"),
                                    (ort.OrtValue, "from_dlpack")) if hasattr(owner, name)]
    row("environment", None, f"onnxruntime {ort.__version__}, {ort.get_available_providers()}, "
        f"has {has}")
    try:
        model = build_decoder(Path(args.out) / f"probe-{args.preset}", preset=args.preset,
                              dtype="float16")
    except Exception as error:  # the model's row; nothing else can run
        return row("model build", False, reason(error))
    row("model build", True, f"{args.preset}, float16: {model}")
    if dry:  # the CPU device dressed as CUDA, its sessions counted as capturing
        off = dataclasses.replace(debug.device_for("cpu"), host_visible=False,
                                  mask_policy=MaskPolicy.CAPACITY)
    else:
        ort.set_default_logger_severity(1)
        off = debug.device_for("cuda", args.device_id, cuda_graphs=False)
    on = dataclasses.replace(off, cuda_graphs=True)
    meter = debug.meter_for(on.device_type, on.device_id)
    chunk, capacity, results = args.chunk_size, args.capacity, {}
    prompt = np.random.default_rng(1).integers(0, 200, 3 * chunk).tolist()
    for label, device in (("off", off), ("on", on)):
        with step(f"graphs {label}"):
            base = meter.used_bytes()
            runtime = onnx_chunk.load(model, device=device, capacity=capacity, chunk_size=chunk)
            runtime.debug.factory.log_severity = 1  # INFO (capture lines): rebuilt so
            runtime.debug.cache.clear()
            loaded, sequence = meter.used_bytes(), runtime.open_sequence()
            opened = meter.used_bytes()
            lines: list[tuple[int, int]] = []
            with ort_log(lines):
                prefill = sequence.prefill(prompt).astype(np.float32)
            decode, token = [prefill], int(np.argmax(prefill))
            for _ in range(6):  # the first decode run learns shapes, the second captures
                with ort_log(lines):
                    decode.append(np.array(sequence.decode(token), dtype=np.float32))
                token = int(np.argmax(decode[-1]))
            began = time.perf_counter()
            for _ in range(64):
                token = int(np.argmax(sequence.decode(token)))
            results[label] = (decode, 64 / (time.perf_counter() - began))
            kv = f"KV {mib(sequence.stats.kv_bytes)}, the sequence added {mib(opened, loaded)}"
            if label == "on":
                row("captures per user run", None if dry else lines[2][0] == 1 and not any(
                    c for c, _ in lines[3:]), f"(capture, 'Start another run') lines: prefill "
                    f"{lines[0]}, decode runs {lines[1:]}")
                extra(runtime, sequence, token, meter, dry)
            runtime.close()
            del runtime, sequence
            row(f"memory, graphs {label} ({meter.name})", None, f"{kv}; over the baseline: "
                f"after load {mib(loaded, base)}, after close {mib(meter.used_bytes(), base)}")
    if len(results) == 2:
        (d_off, r_off), (d_on, r_on) = results["off"], results["on"]
        scale, diffs = max(float(np.abs(d_off[0]).max()), 1.0), [
            float(np.abs(a - b).max()) for a, b in zip(d_off, d_on)]
        for name, diff, what in (("prefill", diffs[0], f"3 chunks of {chunk}: -1, capture, "
                                  "replay"), ("decode", max(diffs[1:]), "6 steps")):
            row(f"replay vs uncaptured ({name})", diff <= 1e-3 * scale,
                f"max |diff| {diff:.2e} over {what} (scale {scale:.1f})")
        row("decode tokens/s", None if dry else r_on >= r_off,
            f"graphs on {r_on:.1f}, off {r_off:.1f} ({r_on / r_off:.2f}x)")


def extra(runtime, sequence, token: int, meter, dry: bool) -> None:
    with runtime.debug.cache.acquire(runtime.debug.runner.decode_key) as session:
        binding = runtime.debug.variants.bindings(session, sequence.slot)[1]
    graph, lines = binding.graphs.ids[0] if binding.graphs.ids else None, list[tuple[int, int]]()
    with step("release and rerun"), ort_log(lines):
        session.release_captured_graph(graph)
        sequence.decode(token)
    row("rerun after release", None, f"graph {graph}: (capture, rerun) lines {lines[-1]} (a "
        "capture: freed and captured again; none: still replayed)")
    worker = threading.Thread(target=lambda: sequence.decode(token))
    with step("another thread"), ort_log(lines):
        worker.start()
        worker.join(60)
    row("run from another thread", None, f"graph {graph} in a new thread: {lines[-1]} (a "
        "capture: graphs are per thread; none: the thread replayed)")
    before = meter.used_bytes()
    with step("50 captures"), ort_log(lines):
        for index in range(50):
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(10_000 + index))
            session.run_with_iobinding(binding.io, options)
    row("memory for 50 captures", None, f"{mib(meter.used_bytes(), before)} under 50 new "
        f"ids; {lines[-1][0]} capture lines")
    with step("placement"):
        made = runtime.debug.factory
        placed = debug.SessionFactory(
            made.model_path, runtime.debug.weights, made.device, query_dim=made.query_dim,
            fixed_dims=made.fixed_dims,
            session_config={"session.record_ep_graph_assignment_info": "1"}).create(
                None, prepack=False)
        nodes = [(sub.ep_name, node.op_type) for sub in
                 placed.get_provider_graph_assignment_info() for node in sub.get_nodes()]
        memcpy = sum(op.startswith("Memcpy") for _, op in nodes)
        row("node placement", None if dry else memcpy == 0, f"{len(nodes)} nodes, {memcpy} "
            f"Memcpy, by provider { {e: [n for n, _ in nodes].count(e) for e, _ in nodes} }")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    for name, kind in (("--preset", str), ("--out", str), ("--chunk-size", int),
                       ("--capacity", int), ("--device-id", int)):
        parser.add_argument(name, type=kind, default=None if kind is str else 0)
    args = parser.parse_args()
    dry, out = args.dry_run, args.out or tempfile.mkdtemp(prefix="cuda-probe.")
    args.preset, args.out = args.preset or ("tiny" if dry else "bench"), out
    args.chunk_size, args.capacity = args.chunk_size or (16, 256)[not dry], \
        args.capacity or (256, 2048)[not dry]
    stand_in = (debug.sessions_count_as_capturing if dry and IMPORT_ERROR is None
                else contextlib.nullcontext)  # the dry run's CPU sessions count as capturing
    with step("probe"), stand_in():
        probe(args) if IMPORT_ERROR is None else row("import", "FAIL", IMPORT_ERROR)
    width = max(30, *(len(name) for name, _, _ in ROWS))
    print(f"\n{'check':<{width}}  result  detail", *(f"{name:<{width}}  {verdict:<6}  {detail}"
                                                     for name, verdict, detail in ROWS), sep="\n")
    sys.exit(1 if any(verdict == "FAIL" for _, verdict, _ in ROWS) else 0)


if __name__ == "__main__":
    main()
