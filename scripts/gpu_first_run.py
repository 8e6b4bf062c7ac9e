"""One step of the first GPU run (scripts/gpu_first_run.sh runs each in its own process).

Each step prints its rows as `row: NAME | VERDICT | DETAIL` (ok, FAIL or info) and exits 1 when
a row failed. `--dry-run`: the same code on CPU, the CPU device dressed as CUDA (its sessions
counted as capturing); `--simulate capture-failure` (dry run) makes the first run under graph
id 1 fail as a CUDA capture can. The identity step probes each forward (a decode run writes the
KV cache in place), so it feeds `Sequence.decode` its own greedy tokens; the other steps
generate with `Sequence.generate`.

    python scripts/gpu_first_run.py STEP [--dry-run] [--device-id N] [--simulate WHAT]
    STEP: environment | surface | identity | native | concurrency
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROWS: list[tuple[str, str]] = []
try:
    import numpy as np
    import onnxruntime as ort

    import onnx_chunk
    from onnx_chunk.graph.query_seqlens import query_seqlens_index
    from onnx_chunk.models import build_decoder
    from onnx_chunk.runtime import MaskPolicy, debug
    IMPORT_ERROR = None
except Exception as error:  # every step's one row
    IMPORT_ERROR = f"{type(error).__name__}: {error}"

SIMULATED = "simulated: operation not permitted when stream is capturing"
# Where the runtime keeps its records, the native-chunks trust among them
# (onnx_chunk/runtime/device/native_trust.py).
CACHE_VARIABLE = "ONNX_CHUNK_CACHE"


def row(name: str, verdict: bool | None, detail: str) -> None:
    text = {True: "ok", False: "FAIL", None: "info"}[verdict]
    ROWS.append((name, text))
    print(f"row: {name} | {text} | {' '.join(detail.split())[:300]}", flush=True)


def reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"


def device(args, graphs: bool):
    """The CUDA device, or on a dry run the CPU device dressed as one (`main` counts its
    sessions as capturing)."""
    if not args.dry_run:
        return debug.device_for("cuda", args.device_id, cuda_graphs=graphs)
    return dataclasses.replace(debug.device_for("cpu"), host_visible=False,
                               mask_policy=MaskPolicy.CAPACITY, cuda_graphs=graphs)


def model(args, name: str) -> Path:
    return build_decoder(Path(args.out) / name, preset="tiny", dtype="float16")


def environment(args) -> None:
    row("environment: onnxruntime", None, f"{ort.__version__} at {Path(ort.__file__).parent}, "
        f"providers {ort.get_available_providers()}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        row("environment: driver", None if args.dry_run else False, "no nvidia-smi")
    else:
        found = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=10)
        row("environment: driver", found.returncode == 0, found.stdout.strip() or found.stderr)
    failure = None if args.dry_run else debug.probe_cuda(args.device_id, quiet=False)
    if failure is not None:
        row("environment: CUDA session", False, failure)
    needed, mapped = debug.ort_cudart_soname(), debug.mapped_cudart()
    loaded = debug.cudart()
    detail = (f"ONNX Runtime's CUDA provider needs {needed}; mapped after a CUDA session: "
              f"{mapped or 'none'}; the runtime loads {debug.cudart_candidates()[:1]}")
    majors = {name.split(".so.")[1].split(".")[0] for name in (Path(path).name for path in mapped)
              if ".so." in name}
    ours = needed is not None and any(Path(path).name.startswith(needed) for path in mapped)
    row("environment: libcudart", None if args.dry_run else (
        len(majors) == 1 and ours and loaded is not None), detail)


def surface(args) -> None:
    gaps = debug.cuda_api_gaps()
    row("version surface", not gaps, f"onnxruntime {ort.__version__}: " + (
        f"lacks {gaps}; {debug.cuda_install_command()}" if gaps else
        "has every API the CUDA path uses") + f"; query_seqlens input index "
        f"{query_seqlens_index()}; release_captured_graph "
        f"{hasattr(ort.InferenceSession, 'release_captured_graph')}")


def identity_step(args) -> None:
    on = device(args, graphs=False)
    failure = debug.bind_time_copy(on)
    row("device identity: probe", failure is None, failure or "an owned buffer written after "
        "binding was read in place by the session")
    path = model(args, "identity")
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 200, 21).tolist()
    runs = {}
    for label, owned in (("owned", True), ("onnxruntime", False)):
        debug.record_binding_check(on, owned)
        live = debug.live_buffers()
        runtime = onnx_chunk.load(path, device=on, capacity=64, chunk_size=16)
        sequence = runtime.open_sequence()
        logits = [np.array(sequence.prefill(prompt), dtype=np.float32)]
        kv = sequence.buffers.kv[0]
        heads, capacity, size = kv.shape[1:]
        changed = []
        for step in range(2):  # two decode runs: rows 21 and 22 of the cache
            position = len(prompt) + step
            before = _row(kv, heads, capacity, size, position)
            logits.append(np.array(sequence.decode(int(np.argmax(logits[-1]))),
                                   dtype=np.float32))
            changed.append(not np.array_equal(before, _row(kv, heads, capacity, size,
                                                              position)))
        runs[label] = (logits, changed, debug.live_buffers() - live)
        runtime.close()
    debug.forget_binding_checks()
    (mine, changed, held), (theirs, _, _) = runs["owned"], runs["onnxruntime"]
    row("device identity: KV in place", all(changed) and held > 0, f"rows at seqlens_k "
        f"changed in the owned KV buffer: {changed}; owned buffers held: {held}")
    diff = max(float(np.abs(a - b).max()) for a, b in zip(mine, theirs))
    row("device identity: logits", diff <= 1e-3 * max(1.0, float(np.abs(theirs[0]).max())),
        f"owned vs ONNX Runtime's buffers, prefill and two decodes: max |diff| {diff:.2e}")


def _row(kv, heads: int, capacity: int, size: int, position: int) -> np.ndarray:
    """Head 0's key at `position` of a [1, heads, capacity, size] KV buffer (a device copy)."""
    return np.array(kv.read(position * size, size))


def native(args) -> None:
    index = query_seqlens_index()
    if index is None:
        return row("native chunks on the device", None, f"not offered: onnxruntime "
                   f"{ort.__version__}'s GroupQueryAttention has no query_seqlens")
    from onnx_chunk.graph.model_io import load_model, save_model
    from onnx_chunk.passes import convert_model

    on = device(args, graphs=False)
    source = model(args, "native-source")
    converted = convert_model(load_model(source), native_chunks="on").model
    folder = Path(args.out) / "native"
    save_model(converted, folder / "model.onnx", companions_from=source.parent)
    with _trusted_for_the_check(on, Path(args.out) / "trust"):
        padded = onnx_chunk.load(folder, device=on, capacity=128, chunk_size=16, padding=True)
        plain = onnx_chunk.load(folder, device=on, capacity=128, chunk_size=16, padding=False)
    rng = np.random.default_rng(6)
    worst, tokens_equal = 0.0, True
    for length in (5, 21, 37):
        prompt = rng.integers(0, 200, length).tolist()
        with padded.open_sequence() as one, plain.open_sequence() as other:
            a, tokens_a = _greedy(one, prompt)
            b, tokens_b = _greedy(other, prompt)
            worst = max(worst, float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())))
            tokens_equal &= tokens_a == tokens_b
    held = padded.stats.padding == "native"
    ok = held and tokens_equal and worst <= 1e-2
    detail = (f"padding {padded.stats.padding}; padded vs unpadded (5, 21, 37 tokens): "
              f"relative max |diff| {worst:.2e}, greedy tokens equal {tokens_equal}")
    if ok and not args.dry_run:
        detail += f"; recorded in {debug.record_verified(on, detail)}"
    row("native chunks on the device", ok, detail)


@contextlib.contextmanager
def _trusted_for_the_check(on, scratch: Path):
    """Native chunks trusted on `on` in the block: the check runs them before they are
    verified on this build, so a provisional record of it goes to a scratch cache folder
    ($ONNX_CHUNK_CACHE, where the runtime looks for the record)."""
    saved = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(scratch)
    try:
        debug.record_verified(on, "provisional: for the check that decides it")
        yield
    finally:
        if saved is None:
            os.environ.pop(CACHE_VARIABLE)
        else:
            os.environ[CACHE_VARIABLE] = saved


def _greedy(sequence, prompt: list[int], steps: int = 6) -> tuple[np.ndarray, list[int]]:
    """The prompt's last logits row and its `steps` greedy tokens."""
    logits = np.array(sequence.prefill(prompt), dtype=np.float32)
    sequence.rewind(sequence.length)
    return logits, sequence.generate(prompt, steps, eos_token_id=[])


def concurrency(args) -> None:
    on = device(args, graphs=True)
    path = model(args, "concurrency")
    rng = np.random.default_rng(8)
    short = rng.integers(0, 200, 7).tolist()  # a width outside the ladder: uncaptured

    def load(**options):
        return onnx_chunk.load(path, device=on, capacity=128, chunk_size=16, **options)

    reference = load()  # one thread: what the two threads must each get
    # Each ladder tier's chunk twice: its first run learns the shape, the second captures.
    chunks = [rng.integers(0, 200, tier).tolist() for tier in reference.stats.ladder
              for _ in range(2)]
    expected = _tiers_then_decode(reference, chunks)
    with reference.open_sequence() as alone:
        expected_rows = np.array(alone.prefill(short, all_logits=True), dtype=np.float32)
    reference.close()
    if args.simulate == "capture-failure":
        _fail_first_capture()
    runtime = load(idle_sequences=0)  # every close frees its buffers
    errors: list[str] = []
    got: list[tuple[np.ndarray, list[int]]] = []
    worst, opened, done = 0.0, 0, threading.Event()

    def capture_and_replay():
        try:
            got.append(_tiers_then_decode(runtime, chunks))
        except Exception as error:  # the row says what it was
            errors.append(reason(error))
        finally:
            done.set()

    worker = threading.Thread(target=capture_and_replay)
    began = time.monotonic()
    worker.start()
    try:
        while not done.is_set() and time.monotonic() - began < 60:
            with runtime.open_sequence() as sequence:
                rows = np.array(sequence.prefill(short, all_logits=True), dtype=np.float32)
            worst = max(worst, float(np.abs(rows - expected_rows).max()))
            opened += 1
    except Exception as error:  # the row says what it was
        errors.append(reason(error))
    worker.join(60)
    stats = runtime.stats
    row("concurrency: fallbacks", not stats.graph_fallbacks, f"{stats.graphs.captures} "
        f"captures (by width {stats.graphs.by_width}), {stats.graphs.replays} replays, "
        f"fallbacks {stats.graph_fallbacks}")
    row("concurrency: CUDA errors", not errors, "; ".join(errors) or "none in either thread")
    scale = max(1.0, float(np.abs(expected_rows).max()))
    tier_diff = float(np.abs(got[0][0] - expected[0]).max()) if got else float("inf")
    same = bool(got) and got[0][1] == expected[1]
    row("concurrency: logits", worst <= 1e-3 * scale and tier_diff <= 1e-3 * scale and same,
        f"{opened} sequences opened and closed for every-row logits beside the captures: max "
        f"|diff| {worst:.2e} against one thread's; the capturing thread's tier logits "
        f"{tier_diff:.2e}, its greedy tokens equal {same}")
    runtime.close()


def _tiers_then_decode(runtime, chunks: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """One sequence: `chunks` prefilled in turn, then 8 forwards at the decode width (its
    capture and replays: the first greedy token, fed as a one-token prompt, and the 7 decode
    steps of its generation); the chunks' last logits rows and the 9 tokens."""
    with runtime.open_sequence() as sequence:
        last = [np.array(sequence.prefill(chunk), dtype=np.float32) for chunk in chunks]
        tokens = [int(np.argmax(last[-1]))]
        tokens += sequence.generate(tokens, 8, eos_token_id=[])
    return np.stack(last), tokens


def _fail_first_capture() -> None:
    """The first user run under a graph id, the capture, fails as a CUDA capture can (a dry
    run's simulation), once."""
    original = ort.InferenceSession.run_with_iobinding
    seen: set[str] = set()

    def run(self, iobinding, run_options=None):
        graph = None if run_options is None else run_options.get_run_config_entry("gpu_graph_id")
        if graph not in (None, "-1") and graph not in seen:
            seen.add(graph)
            if len(seen) == 1:
                raise RuntimeError(SIMULATED)
        return original(self, iobinding, run_options)

    ort.InferenceSession.run_with_iobinding = run


STEPS = {"environment": environment, "surface": surface, "identity": identity_step,
         "native": native, "concurrency": concurrency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument("--simulate", choices=["capture-failure"], default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.simulate and not args.dry_run:
        parser.error("--simulate needs --dry-run")
    if IMPORT_ERROR is not None:
        row(args.step, False, f"import: {IMPORT_ERROR}")
        sys.exit(1)
    with tempfile.TemporaryDirectory(prefix=f"first-run-{args.step}.") as scratch:
        args.out = args.out or scratch
        # A dry run's CPU sessions count as capturing: the graph bookkeeping runs as on CUDA.
        stand_in = (debug.sessions_count_as_capturing() if args.dry_run
                    else contextlib.nullcontext())
        try:
            with stand_in:
                STEPS[args.step](args)
        except Exception as error:  # the step's failure is its row
            row(f"{args.step}: error", False, reason(error))
    sys.exit(1 if any(verdict == "FAIL" for _, verdict in ROWS) else 0)


if __name__ == "__main__":
    main()
