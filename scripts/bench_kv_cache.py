"""KV bytes, peak RSS, TTFT, decode tokens/s and per-operator prefill time of float32, int8 and
int4 KV caches (docs/kv_cache.md).

Usage: bench_kv_cache.py memory FOLDER [FOLDER...] [--shape 1x32768 --shape 8x8192]
                           [--llamacpp GGUF]
       bench_kv_cache.py decode FLOAT_FOLDER FOLDER[+NAME=VALUE] [...]
                           [--positions 1024 4096 8192 16384] [--rounds 3] [--genai FOLDER]
                           [--paired [--piece 512]]
       bench_kv_cache.py profile FOLDER[+NAME=VALUE] [...] [--positions 4096 8192] [--rows 512]
                           [--repeats 2]
       bench_kv_cache.py kernel [--heads 14:2:64] [--system int8 ...] [--positions 4096 8192]
                           [--rows 512] [--repeats 2]

`memory` runs each (folder, slots x capacity) in a fresh child process: it loads the model,
opens `slots` sequences at once, writes every byte of their KV buffers (zeros, as llama.cpp
clears its whole cache when it makes it: every KV page is resident in both, as in a full
cache), serves one short request on each sequence in turn and reports
`stats.kv_bytes` per slot, the share of the KV pages resident (mincore) and the child's own
peak RSS (VmHWM of /proc/self/status; ru_maxrss of a child starts from its parent's).
`--llamacpp GGUF` adds llama.cpp at the same shapes with its f16, q8_0 and q4_0 caches
(`_bench/llamacpp_kv_worker.py` in the llama.cpp venv: one context of `slots` sequences, each
served in turn; the KV bytes llama.cpp's log reports, its VmHWM).
`decode`, at each prompt length of `--positions`: each folder's child generates 33 greedy tokens
(`Sequence.generate`, no EOS stop) from a random prompt of that many tokens: its time to the
first token and the decode tokens/s of the 32 steps after it (`stats.last_generation`), the
folders interleaved round by round, the load average printed beside each number (the machine
may be shared); then per length the medians, spreads and the ratios of TTFT and decode tokens/s
to the first folder's (give the float cache first), and how many of the 33 greedy tokens equal
the first folder's before the first that differs, per round. `--paired` loads every folder in
one child per round and alternates them `--piece` prompt tokens at a time, then decode step by
step (in rotating order), so that all meet the same load: on a shared machine separate
processes spread too widely to compare.
`--genai FOLDER` adds onnxruntime-genai (`_bench/genai_worker.py` in `--genai-venv`) on that
folder (the float-cache export as built) in the same rounds: the same prompt, prefilled in
chunks of 512 (its `search.chunk_size`), then 33 greedy tokens, timed as genai's decode
tokens/s after the first (its prefill: the time to the first token). Every system reads the
prompt from one file the parent writes.
`profile` runs one `--rows`-row forward after each past length of `--positions` under ONNX
Runtime's profiler on a plain session (KV buffers at capacity bound as past and present, random
codes; the last row's logits), one child per folder and length, and prints the time of each
operator type in milliseconds, medians of `--repeats` forwards after a warm-up one, the
forward's wall time (median and spread) and the child's peak RSS (VmHWM).
`kernel` times one GroupQueryAttention node of `--heads` HEADS:KV_HEADS:HEAD_SIZE alone, per
cache type and kernel (`_bench/gqa_kernel.py`: float32, int8 and int4 in ONNX Runtime's kernels,
int8 per-tensor, int8 without flash attention, int8 and int4 after passes.kv_prefill),
alternated forward by forward in this process: milliseconds, the ratio to the first system and
GMAC/s over every query row and position.
`FOLDER+NAME=VALUE` runs that folder's child with the environment variable NAME set to VALUE
(ONNX Runtime reads some kernel switches so, e.g. ORT_MLAS_QKGEMM_S8_APPROX_VNNI=1): an arm of
its own beside the same folder without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import environment as env
from _bench import gqa_kernel
from _bench.environment import WORKERS, llama_python

LLAMA_CACHES = ("f16", "q8_0", "q4_0")

_CHILD = r"""
import ctypes, json, mmap, os, sys, time
import numpy as np
import onnx_chunk
request = json.loads(sys.argv[1])
def vmhwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
def resident_pages(array):
    # (resident, all) pages under the array, by mincore(2).
    page = mmap.PAGESIZE
    first = array.ctypes.data // page * page
    pages = -(-(array.ctypes.data + array.nbytes - first) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(first, pages * page, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector), pages
if request["mode"] == "memory":
    with onnx_chunk.load(request["folder"], provider="cpu",
                         capacity=request["capacity"]) as runtime:
        sequences = [runtime.open_sequence() for _ in range(request["slots"])]
        kv = [buffer for sequence in sequences for buffer in sequence.buffers.kv]
        for buffer in kv:
            buffer.zero()
        for slot, sequence in enumerate(sequences):
            sequence.generate([5 + slot, 6, 7, 8], 4, eos_token_id=[])
        pages = [resident_pages(buffer.host) for buffer in kv]
        stats = runtime.stats
        print(json.dumps({"kv_bytes": stats.kv_bytes, "kv_dtype": stats.kv_dtype,
                          "kv_resident": sum(p[0] for p in pages) / sum(p[1] for p in pages),
                          "peak_rss": vmhwm()}))
        for sequence in sequences:
            sequence.close()
elif request["mode"] == "decode":
    with open(request["prompt_file"]) as file:
        prompt = json.load(file)[0]
    with onnx_chunk.load(request["folder"], provider="cpu",
                         capacity=len(prompt) + 64) as runtime:
        with runtime.open_sequence() as sequence:
            tokens = sequence.generate(prompt, 33, eos_token_id=[])
            generation = sequence.stats.last_generation
        print(json.dumps({"kv_dtype": runtime.stats.kv_dtype,
                          "tokens_per_s": generation.decode_tokens_per_s,
                          "prefill_s": generation.ttft_s, "tokens": tokens,
                          "environment": {name: os.environ.get(name)
                                          for name in request["environment"]}}))
else:  # "paired": every folder in this process, alternated piece by piece, step by step
    with open(request["prompt_file"]) as file:
        prompt = json.load(file)[0]
    runtimes = [onnx_chunk.load(folder, provider="cpu", capacity=len(prompt) + 64)
                for folder in request["folders"]]
    sequences = [runtime.open_sequence() for runtime in runtimes]
    count, piece = len(runtimes), request["piece"]
    prefill_s, decode_s = [0.0] * count, [0.0] * count
    tokens = [[] for _ in runtimes]
    for step, start in enumerate(range(0, len(prompt), piece)):
        for index in [(step + shift) % count for shift in range(count)]:
            began = time.perf_counter()
            logits = sequences[index].prefill(prompt[start:start + piece])
            if start + piece >= len(prompt):
                tokens[index].append(int(np.argmax(logits)))
            prefill_s[index] += time.perf_counter() - began
    for step in range(32):
        for index in [(step + shift) % count for shift in range(count)]:
            began = time.perf_counter()
            tokens[index].append(int(np.argmax(sequences[index].decode(tokens[index][-1]))))
            decode_s[index] += time.perf_counter() - began
    print(json.dumps([{"kv_dtype": runtime.stats.kv_dtype, "tokens_per_s": 32 / decode_s[index],
                       "prefill_s": prefill_s[index], "tokens": tokens[index]}
                      for index, runtime in enumerate(runtimes)]))
    for sequence, runtime in zip(sequences, runtimes):
        sequence.close()
        runtime.close()
"""


def _child(request: dict, environment: dict[str, str] | None = None) -> Any:
    """The child's JSON answer: a dict, a list of them for "paired"."""
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(request)],
                          capture_output=True, text=True, check=True,
                          env=None if not environment else {**os.environ, **environment})
    return json.loads(done.stdout.strip().splitlines()[-1])


_ENV_ARM = re.compile(r"^(?P<folder>.+)\+(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>[^+]*)$")


def split_arm(system: str) -> tuple[str, dict[str, str]]:
    """`FOLDER+NAME=VALUE` -> (FOLDER, {NAME: VALUE}); a plain FOLDER -> (FOLDER, {})."""
    found = _ENV_ARM.match(system)
    if found is None or Path(system).is_dir():
        return system, {}
    return found["folder"], {found["name"]: found["value"]}


def _label(system: str) -> str:
    folder, environment = split_arm(system)
    return os.path.basename(folder.rstrip("/")) + "".join(
        f" +{name}={value}" for name, value in environment.items())


def _genai_child(python: Path, folder: str, prompt_file: str, positions: int) -> dict:
    argv = env.worker_argv(python, "genai_worker", {
        "model": folder, "prompts_file": prompt_file, "new_tokens": 33, "chunk_size": 512,
        "max_length": positions + 64, "threads": 2})
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: onnxruntime-genai's child failed: {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])["results"][0]
    return {"tokens_per_s": result["decode_tokens_per_s"], "prefill_s": result["ttft_s"]}


def _prompt_file(folder: Path, positions: int) -> str:
    """A JSON file holding one random prompt of `positions` ids below `folder`'s vocabulary."""
    import numpy as np

    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(10, vocab, positions).tolist()
    descriptor, path = tempfile.mkstemp(suffix=".json", prefix="bench_kv_prompt_")
    with os.fdopen(descriptor, "w") as file:
        json.dump([prompt], file)
    return path


def _llama_child(python: Path, request: dict) -> dict:
    done = subprocess.run([str(python), str(WORKERS / "llamacpp_kv_worker.py"),
                           json.dumps(request)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: llama.cpp's child failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


_PROFILE_CHILD = r"""
import json, os, sys, time
import numpy as np, onnxruntime as ort
from profile_prefill import per_run_node_times
request = json.loads(sys.argv[1])
folder, past, rows = request["folder"], request["past"], request["rows"]
options = ort.SessionOptions()
options.intra_op_num_threads = request["threads"]
options.enable_profiling = True
options.profile_file_prefix = os.path.join(request["tmp"], "bench_kv_profile")
session = ort.InferenceSession(os.path.join(folder, "model.onnx"), options,
                               providers=["CPUExecutionProvider"])
genai = json.load(open(os.path.join(folder, "genai_config.json")))["model"]
io, kept, rng = session.io_binding(), [], np.random.default_rng(0)
def bind(name, array, output=False):
    kept.append(array)
    (io.bind_output if output else io.bind_input)(name, "cpu", 0, array.dtype, list(array.shape),
                                                  array.ctypes.data)
kinds = {"tensor(float)": np.float32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}
for each in session.get_inputs():
    if each.name.startswith("past_key_values."):
        width = each.shape[3] if isinstance(each.shape[3], int) else genai["decoder"]["head_size"]
        shape, kind = (1, each.shape[1], past + rows, width), kinds[each.type]
        buffer = (rng.standard_normal(shape).astype(kind) if kind == np.float32
                  else rng.integers(0, 100, shape).astype(kind))
        bind(each.name, buffer)
        bind("present." + each.name.removeprefix("past_key_values."), buffer, output=True)
names = {each.name for each in session.get_inputs()}
bind("input_ids", rng.integers(10, genai["vocab_size"], (1, rows)).astype(np.int64))
bind("attention_mask", np.ones((1, past + rows), np.int64))
last = "logits_rows" in names
if last:
    bind("logits_rows", np.array([rows - 1], np.int64))
bind("logits", np.empty((1, 1 if last else rows, genai["vocab_size"]), np.float32), output=True)
walls = []
for _ in range(request["repeats"] + 1):  # the first forward is the warm-up
    began = time.perf_counter()
    session.run_with_iobinding(io)
    walls.append(time.perf_counter() - began)
path = session.end_profiling()
events = json.load(open(path))
os.unlink(path)
by_op = []
for run in per_run_node_times(events)[1:]:
    totals = {}
    for op_type, seconds in run.values():
        totals[op_type] = totals.get(op_type, 0.0) + seconds
    by_op.append(totals)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print(json.dumps({"walls": walls[1:], "by_op": by_op, "peak_rss": peak}))
"""


def _profile(folders: list[str], positions: list[int], rows: int, repeats: int,
             threads: int) -> None:
    """One `rows`-row forward at each past length under ONNX Runtime's profiler, per folder
    (each a fresh child process): seconds per operator type, medians of `repeats` forwards."""
    scripts = str(Path(__file__).resolve().parent)
    for past in positions:
        table: dict[str, dict[str, float]] = {}
        walls = {}
        for system in folders:
            folder, environment = split_arm(system)
            request = {"folder": folder, "past": past, "rows": rows, "repeats": repeats,
                       "threads": threads, "tmp": tempfile.gettempdir()}
            load = _load()
            done = subprocess.run([sys.executable, "-c", _PROFILE_CHILD, json.dumps(request)],
                                  capture_output=True, text=True, check=True,
                                  env={**os.environ, **environment,
                                       "PYTHONPATH": scripts})
            got = json.loads(done.stdout.strip().splitlines()[-1])
            walls[system] = (statistics.median(got["walls"]), min(got["walls"]),
                             max(got["walls"]), load, got["peak_rss"])
            for op_type in {name for run in got["by_op"] for name in run}:
                table.setdefault(op_type, {})[system] = statistics.median(
                    run.get(op_type, 0.0) for run in got["by_op"])
        print(f"{rows} rows after {past} positions, ms per forward (median of {repeats}; "
              "If includes the ops of its branch, listed under their own names too)")
        print(f"{'operator':>28} " + " ".join(f"{_label(system)[:22]:>22}" for system in folders))
        for op_type, cells in sorted(table.items(), key=lambda item: -max(item[1].values())):
            print(f"{op_type:>28} " + " ".join(f"{cells.get(system, 0.0) * 1e3:22.3f}"
                                                for system in folders))
        print(f"{'forward (wall)':>28} " + " ".join(
            f"{walls[s][0] * 1e3:22.1f}" for s in folders))
        print(f"{'forward spread':>28} " + " ".join(
            f"{walls[s][1] * 1e3:>10.1f}-{walls[s][2] * 1e3:<11.1f}" for s in folders))
        print(f"{'peak RSS (MiB)':>28} " + " ".join(f"{walls[s][4] / 2**20:22.1f}"
                                                    for s in folders))
        print(f"{'load before':>28} " + " ".join(f"{walls[s][3]:>22}" for s in folders),
              flush=True)


def _round(args: argparse.Namespace, genai: Path | None, systems: list[str],
           prompt_file: str, positions: int) -> list[dict]:
    """One round: every system's TTFT, decode tokens/s and greedy tokens, in `systems` order."""
    if args.paired:
        return _child({"mode": "paired", "folders": args.folders, "prompt_file": prompt_file,
                       "piece": args.piece})
    found = []
    for system in systems:
        if genai is not None and system.startswith("genai:"):
            found.append({**_genai_child(genai, str(args.genai), prompt_file, positions),
                          "kv_dtype": "genai", "tokens": None})
        else:
            folder, environment = split_arm(system)
            got = _child({"mode": "decode", "folder": folder, "prompt_file": prompt_file,
                          "environment": sorted(environment)}, environment)
            if got["environment"] != environment:  # the child saw what it was given
                raise SystemExit(f"error: {system}: the child's environment was "
                                 f"{got['environment']}")
            found.append(got)
        time.sleep(1)
    return found


def _decode(args: argparse.Namespace, genai: Path | None) -> None:
    """Prefill then decode, systems interleaved round by round at each prompt length; per
    length the medians, spreads and ratios to the first system (the float cache)."""
    systems = [*args.folders, *([] if args.genai is None else [f"genai:{args.genai}"])]
    for positions in args.positions:
        prompt_file = _prompt_file(Path(split_arm(args.folders[0])[0]), positions)
        decodes: list[list[float]] = [[] for _ in systems]
        prefills: list[list[float]] = [[] for _ in systems]
        agree: list[list[int]] = [[] for _ in systems]
        loads: list[float] = []
        try:
            for _ in range(args.rounds):
                loads.append(float(_load()))
                found = _round(args, genai, systems, prompt_file, positions)
                loads.append(float(_load()))
                first = found[0]["tokens"]
                for index, got in enumerate(found):
                    decodes[index].append(got["tokens_per_s"])
                    prefills[index].append(got["prefill_s"])
                    if got["tokens"] is not None and first is not None:
                        agree[index].append(next((at for at, (a, b) in enumerate(
                            zip(got["tokens"], first)) if a != b), len(first)))
                    print(f"{positions:>6} {got['kv_dtype']:>8} {got['tokens_per_s']:7.2f} "
                          f"tok/s  prefill {got['prefill_s']:.2f} s  load {_load()}  "
                          f"{_label(systems[index])}", flush=True)
        finally:
            os.unlink(prompt_file)
        base_ttft, base_decode = statistics.median(prefills[0]), statistics.median(decodes[0])
        print(f"{positions} positions, {args.rounds} rounds"
              f"{' paired' if args.paired else ''}, load {min(loads):.1f}-{max(loads):.1f}; "
              f"ratios to {_label(systems[0])}; greedy tokens equal to its, of 33:")
        for index, system in enumerate(systems):
            ttft, decode = prefills[index], decodes[index]
            equal = "/".join(str(count) for count in agree[index]) or "-"
            print(f"  TTFT {statistics.median(ttft):8.3f} s ({min(ttft):.3f}-{max(ttft):.3f}) "
                  f"{statistics.median(ttft) / base_ttft:5.2f}x   decode "
                  f"{statistics.median(decode):6.2f} tok/s ({min(decode):.2f}-"
                  f"{max(decode):.2f}) {statistics.median(decode) / base_decode:5.2f}x  "
                  f"equal {equal}  {_label(system)}", flush=True)


def _kernel(args: argparse.Namespace) -> None:
    """One GroupQueryAttention node per cache type (_bench/gqa_kernel.py), alternated."""
    heads, kv_heads, size = (int(part) for part in args.heads.split(":"))
    systems = args.system or list(gqa_kernel.SYSTEMS)
    for past in args.positions or [4096, 8192]:
        load = _load()
        got = gqa_kernel.measure(systems, (heads, kv_heads, size), past, args.rows,
                                 args.repeats, args.threads)
        base = got[systems[0]]["median"]
        print(f"one GroupQueryAttention {heads}:{kv_heads}:{size}, {args.rows} rows after {past} "
              f"positions, {args.repeats} forwards each, load {load}-{_load()}:")
        for system in systems:
            row = got[system]
            print(f"  {system:>13} {row['median'] * 1e3:9.2f} ms ({row['min'] * 1e3:.2f}-"
                  f"{row['max'] * 1e3:.2f}) {row['median'] / base:5.2f}x  "
                  f"{row['gmacs']:7.2f} GMAC/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("memory", "decode", "profile", "kernel"))
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--shape", action="append", default=None,
                        help="SLOTSxCAPACITY (memory; default 1x32768 and 8x8192)")
    parser.add_argument("--positions", type=int, nargs="+", default=None,
                        help="prompt lengths (decode; default 1024 4096 8192 16384), past "
                             "lengths (profile; default 4096 8192)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (decode)")
    parser.add_argument("--paired", action="store_true",
                        help="decode: every folder in one process per round, alternated "
                             "--piece prompt tokens at a time and decode step by step, so that "
                             "all meet the same load (a shared machine)")
    parser.add_argument("--piece", type=int, default=512,
                        help="prompt tokens per turn with --paired (default 512, a chunk)")
    parser.add_argument("--rows", type=int, default=512, help="query rows (profile, kernel)")
    parser.add_argument("--heads", default="14:2:64",
                        help="kernel: HEADS:KV_HEADS:HEAD_SIZE (default qwen05's 14:2:64)")
    parser.add_argument("--system", action="append", choices=gqa_kernel.SYSTEMS, default=None,
                        help=f"kernel: systems to time (default {' '.join(gqa_kernel.SYSTEMS)})")
    parser.add_argument("--repeats", type=int, default=2,
                        help="profiled forwards after the warm-up one (profile)")
    parser.add_argument("--llamacpp", type=Path, default=None,
                        help="a .gguf of the same model: llama.cpp's caches too (memory)")
    parser.add_argument("--threads", type=int, default=2,
                        help="llama.cpp's threads; ONNX Runtime's (profile)")
    parser.add_argument("--genai", type=Path, default=None,
                        help="decode: also onnxruntime-genai on this folder (the float export)")
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai",
                        help="venv holding onnxruntime-genai (created when missing)")
    args = parser.parse_intermixed_args()
    if args.llamacpp is not None and not args.llamacpp.is_file():
        parser.error(f"--llamacpp {args.llamacpp}: no such file")
    llama = None if args.llamacpp is None else llama_python()
    if llama is not None and not llama.is_file():
        parser.error(f"no llama.cpp venv at {llama}: run scripts/bench_vs_llamacpp.py once "
                     "(it makes it) or set ONNX_CHUNK_LLAMACPP_PYTHON")
    if args.mode == "kernel":
        _kernel(args)
        return
    if not args.folders:
        parser.error(f"{args.mode} needs at least one FOLDER")
    for system in args.folders:
        if not Path(split_arm(system)[0]).is_dir():
            parser.error(f"{system}: no such folder (FOLDER or FOLDER+NAME=VALUE)")
    if args.mode == "profile":
        _profile(args.folders, args.positions or [4096, 8192], args.rows, args.repeats,
                 args.threads)
        return
    if args.mode == "memory":
        for shape in args.shape or ["1x32768", "8x8192"]:
            slots, capacity = (int(part) for part in shape.split("x"))
            for folder in args.folders:
                got = _child({"mode": "memory", "folder": folder, "slots": slots,
                              "capacity": capacity})
                print(f"{shape:>8} {got['kv_dtype']:>8} KV {got['kv_bytes'] * slots / 2**20:8.1f}"
                      f" MiB ({got['kv_resident']:.0%} resident)  peak RSS "
                      f"{got['peak_rss'] / 2**20:8.1f} MiB  load {_load()}  "
                      f"{os.path.basename(folder.rstrip('/'))}", flush=True)
            if llama is None:
                continue
            for cache in LLAMA_CACHES:
                got = _llama_child(llama, {"model": str(args.llamacpp), "slots": slots,
                                           "capacity": capacity, "cache": cache,
                                           "threads": args.threads})
                print(f"{shape:>8} {cache:>8} KV {got['kv_bytes'] / 2**20:8.1f} MiB  peak RSS "
                      f"{got['peak_rss'] / 2**20:8.1f} MiB  load {_load()}  llama.cpp "
                      f"{args.llamacpp.name}", flush=True)
        return
    if args.genai is not None and not (args.genai / "genai_config.json").is_file():
        parser.error(f"--genai {args.genai}: no genai_config.json there")
    if args.paired and (args.genai is not None or any(split_arm(system)[1]
                                                       for system in args.folders)):
        parser.error("--paired runs every folder in one process: no --genai and no "
                     "FOLDER+NAME=VALUE arm")
    args.positions = args.positions or [1024, 4096, 8192, 16384]
    _decode(args, None if args.genai is None else env.genai_python(args.genai_venv))


if __name__ == "__main__":
    main()
