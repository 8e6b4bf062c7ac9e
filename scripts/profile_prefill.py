"""Where a CPU prefill of a builder export spends its time, and what ONNX Runtime can change.

Five commands (issue 34; findings in docs/benchmarks.md, "Prefill candidates on CPU"):

* ``profile``: one ROWS-row forward after ``--past`` positions (default none: a prefill; ``--rows
  5 --past 1000``: verifying four drafts) under ONNX Runtime's profiler
  (SessionOptions.enable_profiling), after warm-up forwards; time per operator type and, for
  MatMul/MatMulNBits/int8 MatMulInteger, per projection (the node name's last two parts:
  attn/qkv_proj, mlp/down_proj, lm_head, ...) with achieved GFLOP/s (2*M*K*N per node) and the
  weight bytes read per second. ``--peak-gflops`` names the machine's peak to compare against;
  without it the script measures numpy's float32 matmul (its BLAS) at 2048^3 on the same
  threads as a practical fp32 roof and prints the nominal clock /proc/cpuinfo reports.
  ``--peak-read-gbs`` likewise names the memory read rate, else measured (numpy's max over 512
  MiB split across the threads): at one row a projection's weight GB/s against it says whether
  the forward is a read of its weights. On a converted graph the lm_head computes every row
  (``--logits-rows all``, the default: a verification) or the last (``last``: a prefill as the
  runtime feeds `logits_rows`); ``compare`` and ``paired`` read the last row alone, as the
  runtime does.
* ``variant``: a copy of an export's graph with one change and the weights untouched (the
  copy's model.onnx.data is a symbolic link to the original's): ``--accuracy-level N``
  rewrites every MatMulNBits' accuracy_level; ``--last-row-logits`` slices the lm_head's input
  to the last query row, so a prefill forward computes one row of logits instead of W.
* ``compare``: a baseline export against candidates, each measurement a fresh process
  (`_bench.child`: peak RSS is the child's own VmHWM), rounds interleaved in rotating order,
  on a bare ONNX Runtime loop (this file's ``worker``: the KV layout of `_bench/ort_loop_worker`,
  one KV buffer per layer at capacity bound as past and present, W rows per prefill forward,
  numpy argmax per new token). A candidate is ``NAME=FOLDER[,key=value...]``: keys are ONNX
  Runtime session config entries (``session.intra_op.allow_spinning=0``) or ``threads=N``.
  Prints TTFT, decode tokens/s and peak RSS as ``median ±spread`` per prompt length, each
  candidate's ratio to the baseline (TTFT and RSS under 1, decode over 1 favour the candidate),
  the greedy agreement with the baseline (leading new tokens identical, of N), and the
  1-minute load average before each measurement.
* ``paired``: the baseline and one candidate at a time in one process, forward by forward
  (A B, B A, ...), so that both meet the same load: the median of the per-pair prefill ratios,
  the ratio of the best forwards, a decode step's ratio and the greedy agreement over
  ``--new-tokens``. For a loaded machine, where separate processes spread too widely.
* ``kernel``: one MatMulNBits node (``BITS:BLOCK:LEVEL``; ``32:0:0`` a float MatMul;
  ``rows8`` what ``convert --int8-matmul`` makes of a 4-bit block-32 node: per-row int8
  activations and MatMulInteger; ``dq8`` an int8 DynamicQuantizeMatMul, one activation
  scale per tensor, which that option wrote before) of random weights at a prefill's shape,
  its best and median seconds and GOP/s, against the roofs given (``--int8-roof``,
  ``--fp32-roof``); ``--no-amx`` runs it as on an AVX-512 CPU without AMX
  (`_bench/no_amx.py`).
* ``roof``: those roofs, measured: the int8 multiply-add and fp32 FMA rates a C loop built
  here at ``-march=native`` reaches on 1 and ``--threads`` threads (`_bench/roof.py`).

    .venv/bin/python scripts/profile_prefill.py profile --model qwen05-int4 [--rows 512]
    .venv/bin/python scripts/profile_prefill.py variant --model qwen05-int4 --out DIR \\
        [--accuracy-level 0] [--last-row-logits]
    .venv/bin/python scripts/profile_prefill.py compare --model qwen05-int4 \\
        --candidate level0=DIR [--candidate nospin=BASE,session.intra_op.allow_spinning=0] \\
        [--lengths 128,1000] [--new-tokens 32] [--rounds 3]
    .venv/bin/python scripts/profile_prefill.py paired --model qwen05-int4 \\
        --candidate lastrow=DIR [--rows 256] [--past 0] [--pairs 4]
    .venv/bin/python scripts/profile_prefill.py kernel [--shape 896x4864] \\
        [--kernel 4:32:4 --kernel dq8 --kernel 32:0:0] [--rows 512] [--no-amx] \\
        [--int8-roof 380 --fp32-roof 198]
    .venv/bin/python scripts/profile_prefill.py roof [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAST, PRESENT = "past_key_values.", "present."
LOGITS_ROWS = "logits_rows"  # the optional input `convert` adds (passes/logits_rows.py)
COPIED = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# ----------------------------------------------------------------------------- the ORT loop

def _session(model: Path, threads: int | None, config: dict[str, str], profile: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "profile_prefill")
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


class Loop:
    """One sequence over a builder export: KV buffers at capacity, bound as past and present.

    A converted graph's optional `logits_rows` input is fed as the runtime feeds it: the last
    row of a forward, unless `all_rows` (a verification reads every row); a graph without it
    computes every row's logits."""

    def __init__(self, session, genai: dict, capacity: int) -> None:
        decoder = genai["decoder"]
        self.session, self.vocab = session, genai["vocab_size"]
        self.io = session.io_binding()
        shape = (1, decoder["num_key_value_heads"], capacity, decoder["head_size"])
        self.buffers = []
        for name in (each.name for each in session.get_inputs()):
            if name.startswith(PAST):
                buffer = np.zeros(shape, dtype=np.float32)
                self.buffers.append(buffer)
                self._bind(name, buffer)
                self._bind(PRESENT + name.removeprefix(PAST), buffer, output=True)
        logits = next(each for each in session.get_outputs() if each.name == "logits")
        # A last-row variant's logits keep one row ([batch, 1, vocab]).
        self.one_row = logits.shape[1] == 1
        # An input with a default is one of ONNX Runtime's overridable initializers.
        self.chooses_rows = any(each.name == LOGITS_ROWS for each in (
            *session.get_inputs(), *session.get_overridable_initializers()))

    def _bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        bind = self.io.bind_output if output else self.io.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def forward(self, ids: list[int], past: int, all_rows: bool = False) -> np.ndarray:
        tokens = np.array([ids], dtype=np.int64)
        mask = np.ones((1, past + len(ids)), dtype=np.int64)
        last_only = self.one_row or (self.chooses_rows and not all_rows)
        logits = np.empty((1, 1 if last_only else len(ids), self.vocab), dtype=np.float32)
        self._bind("input_ids", tokens)
        self._bind("attention_mask", mask)
        if self.chooses_rows:
            rows = np.arange(len(ids), dtype=np.int64)
            self._bind(LOGITS_ROWS, rows[-1:] if last_only else rows)
        self._bind("logits", logits, output=True)
        self.session.run_with_iobinding(self.io)
        return logits[0, -1]


def _genai(model: Path) -> dict:
    return json.loads((model.parent / "genai_config.json").read_text())["model"]


def worker(request: dict) -> dict:
    """One measurement: load, prefill in chunks, greedy decode; what `compare` reads."""
    model = Path(request["model"])
    began = time.perf_counter()
    session = _session(model, request.get("threads"), request.get("config", {}))
    load_s = time.perf_counter() - began
    prompt, new_tokens, width = request["prompt"], request["new_tokens"], request["chunk_size"]
    loop = Loop(session, _genai(model), len(prompt) + new_tokens)
    start = time.perf_counter()
    for offset in range(0, len(prompt), width):
        last = loop.forward(prompt[offset:offset + width], offset)
    tokens = [int(np.argmax(last))]
    ttft = time.perf_counter() - start
    while len(tokens) < new_tokens:
        last = loop.forward(tokens[-1:], len(prompt) + len(tokens) - 1)
        tokens.append(int(np.argmax(last)))
    total = time.perf_counter() - start
    return {"load_s": load_s, "results": [{
        "prompt_tokens": len(prompt), "ttft_s": ttft, "total_s": total, "tokens": tokens,
        "decode_tokens_per_s": (len(tokens) - 1) / (total - ttft) if len(tokens) > 1 else None}]}


# ----------------------------------------------------------------------------- profile

def _model_path(value: str, root: Path | None) -> Path:
    from _bench.environment import export_folder

    path = Path(value)
    if path.suffix == ".onnx" and path.is_file():
        return path
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    return export_folder(value, root)[1] / "model.onnx"


def matmul_shapes(model: Path, rows: int, head_rows: int | None = None) -> dict[str, dict]:
    """{node name: K, N, bits, block_size, weight bytes, flops} for MatMulNBits, float MatMul
    and `convert`'s int8 MatMulInteger (its weight bytes: the int8 B and the column scales the
    Mul after its Cast reads). The flops are of `rows` rows, the lm_head's of `head_rows`
    (default `rows`; 1 where `logits_rows` feeds it the last row alone), and of one row in a
    last-row variant (its `logits` keep one row: the head's input is sliced to it)."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    sizes = {}
    for tensor in graph.initializer:
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        sizes[tensor.name] = (count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
                              .itemsize, list(tensor.dims))
    readers: dict[str, list] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    shapes = {}
    for node in graph.node:
        if node.op_type == "MatMulInteger" and node.input[1] in sizes:
            nbytes, dims = sizes[node.input[1]]
            casts = [reader for reader in readers[node.output[0]] if reader.op_type == "Cast"]
            scales = [name for cast in casts for mul in readers[cast.output[0]]
                      if mul.op_type == "Mul" for name in mul.input if name in sizes]
            shapes[node.name] = dict(K=dims[0], N=dims[1], bits=8, block_size=0,
                                     accuracy_level=None,
                                     weight_bytes=nbytes + sum(sizes[name][0] for name in scales))
        elif node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            weight = sum(sizes.get(name, (0, []))[0] for name in node.input[1:] if name)
            shapes[node.name] = dict(K=attrs["K"], N=attrs["N"], bits=attrs["bits"],
                                     block_size=attrs["block_size"],
                                     accuracy_level=attrs.get("accuracy_level", 0),
                                     weight_bytes=weight)
        elif node.op_type == "MatMul" and node.input[1] in sizes:
            nbytes, dims = sizes[node.input[1]]
            shapes[node.name] = dict(K=dims[0], N=dims[1], bits=32, block_size=0,
                                     accuracy_level=None, weight_bytes=nbytes)
    logits = next((value for value in graph.output if value.name == "logits"), None)
    if logits is not None and len(logits.type.tensor_type.shape.dim) > 1 \
            and logits.type.tensor_type.shape.dim[1].dim_value == 1:
        head_rows = 1
    for name, shape in shapes.items():
        computed = rows if head_rows is None or projection(name) != "lm_head" else head_rows
        shape["flops"] = 2 * computed * shape["K"] * shape["N"]
    return shapes


def projection(node_name: str) -> str:
    """`attn/qkv_proj` for `/model/layers.3/attn/qkv_proj/MatMul_Q4`, `lm_head` for the head."""
    parts = [part for part in node_name.split("/") if part]
    if parts and parts[0] == "lm_head":
        return "lm_head"
    if len(parts) >= 4 and parts[1].startswith("layers."):
        return "/".join(parts[2:-1])
    return "/".join(parts[:-1]) or node_name


def per_run_node_times(events: list[dict]) -> list[dict[str, tuple[str, float]]]:
    """{node name: (op type, seconds)} per `model_run` in an ORT profile's events."""
    runs = sorted((event["ts"], event["ts"] + event["dur"]) for event in events
                  if event.get("cat") == "Session" and event.get("name") == "model_run")
    found: list[dict[str, tuple[str, float]]] = [{} for _ in runs]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        for index, (begin, end) in enumerate(runs):
            if begin <= event["ts"] <= end:
                name = event["name"].removesuffix("_kernel_time")
                op_type, seconds = found[index].get(name, (event["args"]["op_name"], 0.0))
                found[index][name] = (op_type, seconds + event["dur"] / 1e6)
                break
    return found


def _run_profiled(model: Path, rows: int, threads: int, repeats: int, config: dict,
                  past: int = 0, all_rows: bool = True):
    session = _session(model, threads, config, profile=True)
    genai = _genai(model)
    prompt = _prompt(genai, rows)
    walls, cpus = [], []
    for _ in range(repeats + 1):  # the first forward is the warm-up
        loop = Loop(session, genai, past + rows)
        began, cpu = time.perf_counter(), time.process_time()
        loop.forward(prompt, past, all_rows)
        walls.append(time.perf_counter() - began)
        cpus.append(time.process_time() - cpu)
    path = session.end_profiling()
    events = json.loads(Path(path).read_text())
    os.unlink(path)
    runs = per_run_node_times(events)[1:]
    return runs, walls[1:], cpus[1:]


def unprofiled_wall_s(model: Path, rows: int, threads: int, repeats: int,
                      config: dict, past: int = 0, all_rows: bool = True) -> float:
    """Median seconds of `repeats` forwards like `_run_profiled`'s in a session without the
    profiler (whose per-node events weigh on a graph of many small nodes); ValueError for
    last-row logits on a graph that cannot choose its rows."""
    session = _session(model, threads, config)
    genai = _genai(model)
    prompt = _prompt(genai, rows)
    warm = Loop(session, genai, past + rows)
    if not (all_rows or warm.chooses_rows or warm.one_row):
        raise ValueError(f"--logits-rows last: {model} has no {LOGITS_ROWS} input to choose "
                         "the lm_head's rows (onnx-chunk convert adds it)")
    warm.forward(prompt, past, all_rows)
    walls = []
    for _ in range(repeats):
        walls.append(_timed(partial(Loop(session, genai, past + rows).forward, prompt, past,
                                    all_rows)))
    return statistics.median(walls)


def _prompt(genai: dict, rows: int) -> list[int]:
    """The ids a profiled forward feeds: spread over the vocabulary, past its first ids."""
    return [3 + (index * 7919) % (genai["vocab_size"] - 3) for index in range(rows)]


def practical_fp32_peak(threads: int, size: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of numpy's float32 matmul at size^3 (its BLAS), the best of `repeats`."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def practical_read_peak(threads: int, megabytes: int = 512, repeats: int = 3) -> float:
    """GB/s at which `threads` threads read a `megabytes` array far larger than the caches
    (numpy's max over each thread's slice, which releases the GIL), the best of `repeats`: the
    rate a one-row forward's weights can stream at."""
    import threading

    data = np.ones(megabytes * 2 ** 20 // 8, np.uint64)
    parts = np.array_split(data, threads)

    def read() -> None:
        workers = [threading.Thread(target=part.max) for part in parts]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    read()
    return data.nbytes / min(_timed(read) for _ in range(repeats)) / 1e9


def _timed(call) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def nominal_mhz() -> float | None:
    try:
        values = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("cpu MHz")]
    except OSError:
        return None
    return max(values) if values else None


def profile_table(runs: list[dict], shapes: dict[str, dict], walls: list[float],
                  cpus: list[float]) -> dict:
    """Median seconds per op type and per projection over the profiled runs; `cpu_s`: the
    process's CPU seconds per forward (all threads), which a loaded machine inflates less than
    wall time when ORT's threads do not spin."""
    by_type: dict[str, list[float]] = defaultdict(list)
    by_projection: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        types: dict[str, float] = defaultdict(float)
        projections: dict[str, float] = defaultdict(float)
        for name, (op_type, seconds) in run.items():
            types[op_type] += seconds
            if name in shapes:
                projections[projection(name)] += seconds
        for key, value in types.items():
            by_type[key].append(value)
        for key, value in projections.items():
            by_projection[key].append(value)
    groups: dict[str, dict] = defaultdict(lambda: {"flops": 0, "weight_bytes": 0, "nodes": 0})
    for name, shape in shapes.items():
        group = groups[projection(name)]
        group["flops"] += shape["flops"]
        group["weight_bytes"] += shape["weight_bytes"]
        group["nodes"] += 1
        group["shape"] = f"K {shape['K']} N {shape['N']} bits {shape['bits']} " \
                         f"block {shape['block_size']} level {shape['accuracy_level']}"
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "op_types": {key: statistics.median(values) for key, values in by_type.items()},
            "projections": {key: dict(groups[key], seconds=statistics.median(values))
                            for key, values in by_projection.items()}}


def _profile(args: argparse.Namespace) -> int:
    model = _model_path(args.model, args.models_root)
    config = dict(_pair(item) for item in args.config)
    load = os.getloadavg()[0]
    all_rows = args.logits_rows == "all"
    # First: it refuses what cannot run before a profiled session starts writing its file.
    plain_s = unprofiled_wall_s(model, args.rows, args.threads, args.repeats, config,
                                args.past, all_rows)
    runs, walls, cpus = _run_profiled(model, args.rows, args.threads, args.repeats, config,
                                      args.past, all_rows)
    table = profile_table(runs, matmul_shapes(model, args.rows, None if all_rows else 1),
                          walls, cpus)
    peak = args.peak_gflops or practical_fp32_peak(args.threads)
    read_peak = args.peak_read_gbs or practical_read_peak(args.threads)
    weights = sum(group["weight_bytes"] for group in table["projections"].values())
    total = sum(table["op_types"].values())
    lines = [f"model {model}, {args.rows} rows after {args.past} positions of past (zeros), "
             f"logits of {'every row' if all_rows else 'the last row'}, "
             f"{args.threads} threads, "
             f"{len(runs)} profiled forwards (median), wall {table['wall_s']:.3f} s, "
             f"CPU {table['cpu_s']:.3f} s (all threads), session config {config}, "
             f"1-minute load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; "
             f"peak {peak:.0f} GFLOP/s ({'given' if args.peak_gflops else 'numpy fp32 matmul'}"
             f"), read {read_peak:.1f} GB/s ("
             f"{'given' if args.peak_read_gbs else 'numpy max over 512 MiB'}), "
             f"nominal clock {nominal_mhz()} MHz; without the profiler a forward takes "
             f"{plain_s:.4f} s (median), its projections' {weights / 1e6:.0f} MB of weights "
             f"read at {weights / plain_s / 1e9:.1f} GB/s", "",
             "| op type | s | share |", "| --- | ---: | ---: |"]
    for key, seconds in sorted(table["op_types"].items(), key=lambda item: -item[1]):
        lines.append(f"| {key} | {seconds:.4f} | {100 * seconds / total:.1f}% |")
    # CPU seconds of a projection: its share of the summed kernel time times the forward's CPU
    # seconds (the load-robust estimate; the wall rate is what the forward saw).
    cpu_per_kernel_s = table["cpu_s"] / total
    # The peak is fp32's: an int8 projection (MatMulInteger, MatMulNBits at accuracy level 4)
    # goes past it; `kernel --int8-roof` sets int8 rates against the int8 roof.
    lines += ["", "| projection | nodes | shape | s | share | GFLOP | GFLOP/s (wall) "
              "| of fp32 peak | GFLOP per CPU-s | weight MB | weight GB/s | of read |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: |"]
    for key, group in sorted(table["projections"].items(), key=lambda item: -item[1]["seconds"]):
        rate = group["flops"] / group["seconds"] / 1e9
        per_cpu = group["flops"] / (group["seconds"] * cpu_per_kernel_s) / 1e9
        streamed = group["weight_bytes"] / group["seconds"] / 1e9
        lines.append(f"| {key} | {group['nodes']} | {group['shape']} | {group['seconds']:.4f} | "
                     f"{100 * group['seconds'] / total:.1f}% | {group['flops'] / 1e9:.1f} | "
                     f"{rate:.1f} | {100 * rate / peak:.0f}% | {per_cpu:.1f} | "
                     f"{group['weight_bytes'] / 1e6:.1f} | {streamed:.1f} | "
                     f"{100 * streamed / read_peak:.0f}% |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(table, peak_gflops=peak,
                                                   read_peak_gbs=read_peak, load=load,
                                                   unprofiled_wall_s=plain_s,
                                                   model=str(model), rows=args.rows,
                                                   past=args.past), indent=1))
    return 0


# ----------------------------------------------------------------------------- paired

def _forward_s(loop: Loop, ids: list[int], past: int) -> tuple[float, np.ndarray]:
    began = time.perf_counter()
    last = loop.forward(ids, past)
    return time.perf_counter() - began, last


def paired_ratios(base: list[float], candidate: list[float]) -> dict:
    """Candidate over base: the median of the per-pair ratios, the ratio of the bests, and the
    spread of the per-pair ratios ((max-min)/median)."""
    ratios = sorted(mine / theirs for mine, theirs in zip(candidate, base, strict=True))
    middle = statistics.median(ratios)
    return {"median": middle, "best": min(candidate) / min(base),
            "spread": (ratios[-1] - ratios[0]) / middle}


def _paired(args: argparse.Namespace) -> int:
    """Base and one candidate in one process, forward by forward (A B B A ...), so that both
    meet the same load; then each decodes greedily from the same prompt."""
    from _bench.harness import seeded_prompt

    base_model = _model_path(args.model, args.models_root)
    genai = _genai(base_model)
    prompt = seeded_prompt(args.past + args.rows, genai["vocab_size"])
    capacity = args.past + args.rows + args.new_tokens
    rows = [f"prefill forward of {args.rows} rows after {args.past} rows of past, decode step "
            f"at {args.past + args.rows}; {args.pairs} pairs per candidate (order A B, B A, "
            f"...), {args.threads} threads unless named; ratios are candidate / base", "",
            "| candidate | prefill ratio (median of pairs) | best / best | pair spread | "
            "decode-step ratio | greedy agreement | base prefill s (median) | load before |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for text in args.candidate:
        name, model, threads, config = parse_candidate(text, args.models_root)
        load = os.getloadavg()[0]
        sessions = {"base": _session(base_model, args.threads, {}),
                    name: _session(model, threads or args.threads, config)}
        loops = {key: Loop(session, genai, capacity) for key, session in sessions.items()}
        for loop in loops.values():  # warm-up, and the past both continue from
            for offset in range(0, args.past, args.chunk_size):
                loop.forward(prompt[offset:min(offset + args.chunk_size, args.past)], offset)
        chunk = prompt[args.past:]
        times: dict[str, list[float]] = {"base": [], name: []}
        steps: dict[str, list[float]] = {"base": [], name: []}
        lasts: dict[str, np.ndarray] = {}
        for index in range(args.pairs):
            order = ("base", name) if index % 2 == 0 else (name, "base")
            for key in order:
                seconds, lasts[key] = _forward_s(loops[key], chunk, args.past)
                times[key].append(seconds)
            for key in order:
                token = int(np.argmax(lasts[key]))
                steps[key].append(_forward_s(loops[key], [token], args.past + args.rows)[0])
        tokens: dict[str, list[int]] = {}
        for key, loop in loops.items():
            _, last = _forward_s(loop, chunk, args.past)
            generated = [int(np.argmax(last))]
            while len(generated) < args.new_tokens:
                last = loop.forward(generated[-1:], args.past + args.rows + len(generated) - 1)
                generated.append(int(np.argmax(last)))
            tokens[key] = generated
        prefill = paired_ratios(times["base"], times[name])
        decode = paired_ratios(steps["base"], steps[name])
        rows.append(f"| {name} | {prefill['median']:.2f}x | {prefill['best']:.2f}x | "
                    f"{100 * prefill['spread']:.0f}% | {decode['median']:.2f}x | "
                    f"{agreement(tokens[name], tokens['base'])}/{args.new_tokens} | "
                    f"{statistics.median(times['base']):.3f} | {load:.2f} |")
        print(rows[-1], file=sys.stderr)
        del loops, sessions
    rows.append(f"\n1-minute load average {os.getloadavg()[0]:.2f} at the end")
    print("\n".join(rows))
    return 0


# ----------------------------------------------------------------------------- kernel

# `--kernel rows8`: one layer as `convert --int8-matmul` writes it (Int8MatMulPass on a 4-bit
# block-32 node: activations quantized per row, MatMulInteger, MLAS's QGEMM);
# `--kernel dq8`: DynamicQuantizeMatMul (int8 weights, one scale per column, the activations
# one scale per tensor), what that option wrote before.
ROW_INT8_KERNEL = "rows8"
INT8_MATMUL_KERNEL = "dq8"


def rows8_model(k: int, n: int):
    """`matmul_model` 4:32:4 rewritten by `convert --int8-matmul`'s pass."""
    import onnx_ir as ir

    from onnx_chunk.passes import Int8MatMulPass

    model = ir.serde.deserialize_model(matmul_model("rows", k, n, 4, 32, 4))
    Int8MatMulPass()(model)
    return ir.serde.serialize_model(model)


def matmul_model(rows_name: str, k: int, n: int, bits: int, block: int, level: int | None,
                 seed: int = 0):
    """A one-node model: MatMulNBits (bits, block, accuracy level), with bits 32 a float MatMul,
    with bits 8 and block 0 a DynamicQuantizeMatMul of int8 weights, one scale a column, of
    [1, rows, k] by a random [k, n] weight (symmetric, no zero points)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, rows_name, k])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, rows_name, n])
    if bits == 8 and block == 0:
        initializers = [
            onnx.numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), "B"),
            onnx.numpy_helper.from_array(
                (rng.random(n, dtype=np.float32) * 0.001).astype(np.float32), "scale"),
            onnx.numpy_helper.from_array(np.zeros(n, np.int8), "zero_point")]
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "scale", "zero_point"],
                                ["Y"], domain="com.microsoft")
    elif bits == 32:
        weight = onnx.numpy_helper.from_array(
            rng.standard_normal((k, n), dtype=np.float32) * 0.02, "B")
        node = helper.make_node("MatMul", ["A", "B"], ["Y"])
        initializers = [weight]
    else:
        blocks = (k + block - 1) // block
        packed = rng.integers(0, 256, size=(n, blocks, block * bits // 8), dtype=np.uint8)
        scales = (rng.random(n * blocks, dtype=np.float32) * 0.01).astype(np.float32)
        initializers = [onnx.numpy_helper.from_array(packed, "B"),
                        onnx.numpy_helper.from_array(scales, "scales")]
        node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                                K=k, N=n, bits=bits, block_size=block,
                                accuracy_level=level or 0)
    graph = helper.make_graph([node], "kernel", [a], [y], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


def time_kernel(model, rows: int, k: int, threads: int, repeats: int,
                config: dict[str, str]) -> list[float]:
    """Seconds of each of `repeats` runs (after one warm-up) of a one-node model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    a = np.random.default_rng(1).standard_normal((1, rows, k), dtype=np.float32)
    session.run(None, {"A": a})
    return [_timed(lambda: session.run(None, {"A": a})) for _ in range(repeats)]


def _without_amx() -> None:
    """Run this command again with the no-AMX shim preloaded (`_bench/no_amx.py`)."""
    from _bench.no_amx import shim

    environment = {**os.environ, "LD_PRELOAD": str(shim()), "ONNX_CHUNK_NO_AMX": "1"}
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)


def _kernel(args: argparse.Namespace) -> int:
    if args.no_amx and os.environ.get("ONNX_CHUNK_NO_AMX") != "1":
        _without_amx()
    config = dict(_pair(item) for item in args.config)
    amx = "refused (no-AMX shim)" if os.environ.get("ONNX_CHUNK_NO_AMX") == "1" else "as given"
    lines = [f"one-node models, {args.rows} rows, {args.threads} threads, {args.repeats} runs "
             f"each (best and median), session config {config}, AMX {amx}; 1-minute load "
             f"average {os.getloadavg()[0]:.2f} before", "",
             "| K x N | kernel | best s | median s | GOP/s (best) | of int8 roof | of fp32 roof |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for shape in args.shape:
        k, n = _ints(shape, "x", 2, "--shape KxN")
        for variant in args.kernel:
            bits, block, level = ((8, 0, 0) if variant in (INT8_MATMUL_KERNEL, ROW_INT8_KERNEL)
                                  else _ints(variant, ":", 3, "--kernel BITS:BLOCK:LEVEL"))
            model = (rows8_model(k, n) if variant == ROW_INT8_KERNEL
                     else matmul_model("rows", k, n, bits, block, level))
            times = time_kernel(model, args.rows, k, args.threads, args.repeats, config)
            rate = 2 * args.rows * k * n / min(times) / 1e9
            name = ("MatMul fp32" if bits == 32 else "DynamicQuantizeMatMul int8"
                    if variant == INT8_MATMUL_KERNEL else "per-row int8 (--int8-matmul)"
                    if variant == ROW_INT8_KERNEL else f"{bits}-bit block {block} level {level}")
            lines.append(f"| {k} x {n} | {name} | {min(times):.4f} | "
                         f"{statistics.median(times):.4f} | {rate:.1f} | "
                         f"{_share(rate, args.int8_roof)} | {_share(rate, args.fp32_roof)} |")
    lines.append(f"\n1-minute load average {os.getloadavg()[0]:.2f} after")
    print("\n".join(lines))
    return 0


def _roof(args: argparse.Namespace) -> int:
    from _bench import roof

    try:
        rates = {threads: roof.measure(threads) for threads in sorted({1, args.threads})}
    except roof.RoofUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    lines = [f"compute roofs, a C loop at -march=native; 1-minute load average "
             f"{os.getloadavg()[0]:.2f}", "",
             "| threads | int8 | int8 GOP/s | fp32 | fp32 GFLOP/s |",
             "| ---: | --- | ---: | --- | ---: |"]
    lines += [f"| {threads} | {got['int8_isa']} | {got['int8_gops']:.1f} | {got['fp32_isa']} | "
              f"{got['fp32_gflops']:.1f} |" for threads, got in rates.items()]
    print("\n".join(lines))
    return 0


def _ints(text: str, separator: str, count: int, what: str) -> list[int]:
    parts = text.split(separator)
    if len(parts) != count or not all(part.isdigit() for part in parts):
        raise ValueError(f"{what}: expected {count} integers separated by {separator!r}, "
                         f"got {text!r}")
    return [int(part) for part in parts]


def _share(rate: float, roof: float | None) -> str:
    return f"{100 * rate / roof:.0f}%" if roof else "-"


# ----------------------------------------------------------------------------- variant

def make_variant(source: Path, out: Path, *, accuracy_level: int | None,
                 last_row: bool) -> Path:
    """A copy of `source`'s graph with the changes asked for, weights linked, not copied."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    if accuracy_level is not None:
        changed = 0
        for node in model.graph.node:
            if node.op_type == "MatMulNBits":
                for attribute in node.attribute:
                    if attribute.name == "accuracy_level":
                        attribute.i = accuracy_level
                        changed += 1
        if not changed:
            raise SystemExit(f"error: {source} has no MatMulNBits with an accuracy_level")
    if last_row:
        from onnx_chunk.validate.reference import slice_last_row

        if not slice_last_row(model.graph):
            raise SystemExit(f"error: {source} has no LM head whose rows can be cut to the "
                             "last one")
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.onnx"
    onnx.save(model, str(target))
    for name in {tensor.external_data[0].value for tensor in model.graph.initializer
                 if tensor.data_location == onnx.TensorProto.EXTERNAL}:
        # ONNX Runtime refuses external data outside the model's folder (a symbolic link
        # resolves there): a hard link where the file system allows it, else a copy.
        link, original = out / name, (source.parent / name).resolve()
        if not link.exists():
            try:
                os.link(original, link)
                print(f"note: {link} is a hard link of {original}: onnx.checker and onnx.load "
                      "refuse those weights while both names exist; remove the variant after")
            except OSError:
                shutil.copy2(original, link)
    for name in COPIED:
        if (source.parent / name).is_file():
            shutil.copy2(source.parent / name, out / name)
    return target


def _variant(args: argparse.Namespace) -> int:
    source = _model_path(args.model, args.models_root)
    if args.accuracy_level is None and not args.last_row_logits:
        print("error: nothing to change: give --accuracy-level or --last-row-logits",
              file=sys.stderr)
        return 2
    target = make_variant(source, args.out, accuracy_level=args.accuracy_level,
                          last_row=args.last_row_logits)
    print(f"wrote {target}")
    return 0


# ----------------------------------------------------------------------------- compare

def _pair(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"error: expected KEY=VALUE, got {item!r}")
    return key, value


def parse_candidate(text: str, root: Path | None) -> tuple[str, Path, int | None, dict]:
    """`NAME=FOLDER[,key=value...]` -> (name, model.onnx, threads or None, session config)."""
    name, folder = _pair(text)
    location, *settings = folder.split(",")
    config = dict(_pair(item) for item in settings)
    threads = config.pop("threads", None)
    return name, _model_path(location, root), int(threads) if threads else None, config


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of `tokens` equal `reference`'s."""
    count = 0
    for mine, theirs in zip(tokens, reference):
        if mine != theirs:
            break
        count += 1
    return count


def _compare(args: argparse.Namespace) -> int:
    from _bench.child import measure_prompt
    from _bench.harness import format_value, round_order, seeded_prompt, summarize

    systems: list[tuple[str, Path, int | None, dict[str, str]]] = [
        ("base", _model_path(args.model, args.models_root), None, {})]
    systems += [parse_candidate(text, args.models_root) for text in args.candidate]
    if len({name for name, *_ in systems}) != len(systems):
        print("error: candidate names must be distinct and not 'base'", file=sys.stderr)
        return 2
    lengths = [int(value) for value in args.lengths.split(",")]
    vocab = _genai(systems[0][1])["vocab_size"]
    runs: dict[tuple[int, str], list[dict]] = defaultdict(list)
    loads: list[float] = []
    by_name = {system[0]: system for system in systems}
    for round_index in range(args.rounds):
        for length in lengths:
            prompt = seeded_prompt(length, vocab)
            for name in round_order(list(by_name), round_index):
                _, model, threads, config = by_name[name]
                request = {"model": str(model), "prompt": prompt, "new_tokens": args.new_tokens,
                           "chunk_size": args.chunk_size, "threads": threads or args.threads,
                           "config": config}
                loads.append(os.getloadavg()[0])
                result = measure_prompt([sys.executable, str(Path(__file__).resolve()),
                                         "worker", json.dumps(request)],
                                        f"round {round_index + 1}/{args.rounds} {length:>5} "
                                        f"tokens {name:<12}")
                runs[(length, name)].append(dict(result, load_1m=loads[-1]))
    rows = [f"model {systems[0][1]}, CPU, {args.threads} threads unless named, chunk "
            f"{args.chunk_size}, {args.new_tokens} new tokens, {args.rounds} rounds; 1-minute "
            f"load average before each measurement: min {min(loads):.2f}, median "
            f"{statistics.median(loads):.2f}, max {max(loads):.2f}", "",
            "| prompt | system | TTFT s | decode tok/s | peak RSS MB | TTFT ratio | decode ratio "
            "| RSS ratio | greedy agreement |",
            "| ---: | --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    fields = (("ttft_s", 3), ("decode_tokens_per_s", 1), ("peak_rss_mb", 0))
    for length in lengths:
        base = runs[(length, "base")]
        for name in by_name:
            mine = runs[(length, name)]
            cells = [format_value(summarize(run[field] for run in mine), digits)
                     for field, digits in fields]
            ratios = [summarize(run[field] for run in mine).median
                      / summarize(run[field] for run in base).median for field, _ in fields]
            agree = min(agreement(run["tokens"], base[0]["tokens"]) for run in mine)
            rows.append(f"| {length} | {name} | {' | '.join(cells)} | "
                        f"{' | '.join(f'{value:.2f}x' for value in ratios)} | "
                        f"{agree}/{args.new_tokens} |")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "systems": {name: [str(model), threads, config]
                        for name, model, threads, config in systems},
            "loads": loads, "runs": {f"{length}/{name}": values
                                     for (length, name), values in runs.items()}}, indent=1))
    return 0


# ----------------------------------------------------------------------------- main

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    profile = commands.add_parser("profile", help="per-operator profile of one prefill forward")
    variant = commands.add_parser("variant", help="an export's graph with one change")
    compare = commands.add_parser("compare", help="baseline against candidates, interleaved")
    kernel = commands.add_parser("kernel", help="one MatMulNBits node at a prefill's shape")
    paired = commands.add_parser("paired", help="base and a candidate forward by forward")
    roof = commands.add_parser("roof", help="the machine's int8 and fp32 compute roofs")
    roof.add_argument("--threads", type=int, default=2)
    paired.add_argument("--model", required=True)
    paired.add_argument("--models-root", type=Path, default=None)
    paired.add_argument("--candidate", action="append", required=True,
                        help="NAME=FOLDER[,key=value...] (repeatable; one at a time)")
    paired.add_argument("--rows", type=int, default=512)
    paired.add_argument("--past", type=int, default=0)
    paired.add_argument("--pairs", type=int, default=6)
    paired.add_argument("--new-tokens", type=int, default=32)
    paired.add_argument("--threads", type=int, default=2)
    paired.add_argument("--chunk-size", type=int, default=512)
    kernel.add_argument("--shape", action="append", default=None,
                        help="KxN (repeatable; default qwen05's 896x4864 and 4864x896)")
    kernel.add_argument("--kernel", action="append", default=None,
                        help="BITS:BLOCK:LEVEL (32:0:0 is a float MatMul), rows8 (a layer as "
                             "convert --int8-matmul writes it) or dq8 (the per-tensor "
                             "DynamicQuantizeMatMul it wrote before); repeatable; "
                             "default 4:32:4 4:32:1 32:0:0")
    kernel.add_argument("--no-amx", action="store_true",
                        help="refuse the process the AMX tile state (a shim built here and "
                             "preloaded), as on an AVX-512 CPU without AMX")
    kernel.add_argument("--rows", type=int, default=512)
    kernel.add_argument("--threads", type=int, default=2)
    kernel.add_argument("--repeats", type=int, default=10)
    kernel.add_argument("--config", action="append", default=[])
    kernel.add_argument("--int8-roof", type=float, default=None,
                        help="GOP/s the machine's int8 multiply-adds reach (for the share)")
    kernel.add_argument("--fp32-roof", type=float, default=None,
                        help="GFLOP/s the machine's fp32 FMAs reach (for the share)")
    for command in (profile, variant, compare):
        command.add_argument("--model", required=True,
                             help="benchmark model name (qwen05-int4) or an export folder")
        command.add_argument("--models-root", type=Path, default=None)
    for command in (profile, compare):
        command.add_argument("--threads", type=int, default=2)
        command.add_argument("--json", default=None, help="also write the numbers here")
    profile.add_argument("--rows", type=int, default=512)
    profile.add_argument("--past", type=int, default=0,
                         help="positions already in the KV cache (zeros) before the forward")
    profile.add_argument("--logits-rows", choices=("all", "last"), default="all",
                         help="the rows a converted graph's lm_head computes: every row (a "
                              "verification; what a graph without logits_rows does) or the "
                              "last (a prefill, as the runtime feeds it)")
    profile.add_argument("--repeats", type=int, default=2, help="profiled forwards (median)")
    profile.add_argument("--config", action="append", default=[],
                         help="ONNX Runtime session config entry KEY=VALUE (repeatable)")
    profile.add_argument("--peak-gflops", type=float, default=None)
    profile.add_argument("--peak-read-gbs", type=float, default=None,
                         help="GB/s the machine reads memory at (default: measured)")
    variant.add_argument("--out", type=Path, required=True)
    variant.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None)
    variant.add_argument("--last-row-logits", action="store_true")
    compare.add_argument("--candidate", action="append", default=[],
                         help="NAME=FOLDER[,key=value...] (repeatable)")
    compare.add_argument("--lengths", default="128,1000")
    compare.add_argument("--new-tokens", type=int, default=32)
    compare.add_argument("--rounds", type=int, default=3)
    compare.add_argument("--chunk-size", type=int, default=512)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return 0
    args = _parser().parse_args(argv)
    try:
        if args.command == "kernel":
            args.shape = args.shape or ["896x4864", "4864x896"]
            args.kernel = args.kernel or ["4:32:4", "4:32:1", "32:0:0"]
            return _kernel(args)
        if args.command == "compare":
            args.lengths = ",".join(str(value) for value in _ints(
                args.lengths, ",", len(args.lengths.split(",")), "--lengths"))
        return {"profile": _profile, "variant": _variant, "compare": _compare,
                "paired": _paired, "roof": _roof}[args.command](args)
    except Exception as error:  # a missing model, a refused session: one line, exit 2
        from _bench.models import BenchModelMissing

        if isinstance(error, BenchModelMissing | FileNotFoundError | ValueError):
            print(f"error: {error}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
