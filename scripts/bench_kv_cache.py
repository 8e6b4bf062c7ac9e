"""KV bytes, peak RSS and decode tokens/s of float32, int8 and int4 KV caches (docs/kv_cache.md).

Usage: bench_kv_cache.py memory FOLDER [FOLDER...] [--shape 1x32768 --shape 8x8192]
                           [--llamacpp GGUF]
       bench_kv_cache.py decode FOLDER[+NAME=VALUE] [...] [--positions 1024] [--rounds 3]
                           [--genai FOLDER]

`memory` runs each (folder, slots x capacity) in a fresh child process: it loads the model,
opens `slots` sequences at once, writes every byte of their KV buffers (zeros, as llama.cpp
clears its whole cache when it makes it: every KV page is resident in both, as in a full
cache), serves one short request on each sequence in turn and reports
`stats.kv_bytes` per slot, the share of the KV pages resident (mincore) and the child's own
peak RSS (VmHWM of /proc/self/status; ru_maxrss of a child starts from its parent's).
`--llamacpp GGUF` adds llama.cpp at the same shapes with its f16, q8_0 and q4_0 caches
(`_bench/llamacpp_kv_worker.py` in the llama.cpp venv: one context of `slots` sequences, each
served in turn; the KV bytes llama.cpp's log reports, its VmHWM). `decode` generates 33 greedy
tokens (`Sequence.generate`, no EOS stop) from a random prompt of `--positions` tokens: the
prefill's seconds are its time to the first token, the decode tokens/s those of the 32 steps
after it (`stats.last_generation`), the folders
interleaved round by round; the load average is printed beside each number (the machine may be
shared).
`--genai FOLDER` adds onnxruntime-genai (`_bench/genai_worker.py` in `--genai-venv`) on that
folder (the float-cache export as built) in the same rounds: the same prompt, prefilled in
chunks of 512 (its `search.chunk_size`), then 33 greedy tokens, timed as genai's decode
tokens/s after the first (its prefill: the time to the first token). Every system reads the
prompt from one file the parent writes.
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

from _bench import environment as env
from _bench.environment import WORKERS, llama_python

LLAMA_CACHES = ("f16", "q8_0", "q4_0")

_CHILD = r"""
import ctypes, json, mmap, os, sys
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
else:
    with open(request["prompt_file"]) as file:
        prompt = json.load(file)[0]
    with onnx_chunk.load(request["folder"], provider="cpu",
                         capacity=len(prompt) + 64) as runtime:
        with runtime.open_sequence() as sequence:
            sequence.generate(prompt, 33, eos_token_id=[])
            generation = sequence.stats.last_generation
        print(json.dumps({"kv_dtype": runtime.stats.kv_dtype,
                          "tokens_per_s": generation.decode_tokens_per_s,
                          "prefill_s": generation.ttft_s,
                          "environment": {name: os.environ.get(name)
                                          for name in request["environment"]}}))
"""


def _child(request: dict, environment: dict[str, str] | None = None) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("memory", "decode"))
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--shape", action="append", default=None,
                        help="SLOTSxCAPACITY (memory; default 1x32768 and 8x8192)")
    parser.add_argument("--positions", type=int, default=1024, help="prompt length (decode)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (decode)")
    parser.add_argument("--llamacpp", type=Path, default=None,
                        help="a .gguf of the same model: llama.cpp's caches too (memory)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--genai", type=Path, default=None,
                        help="decode: also onnxruntime-genai on this folder (the float export)")
    parser.add_argument("--genai-venv", type=Path, default=env.ROOT / ".venv-genai",
                        help="venv holding onnxruntime-genai (created when missing)")
    args = parser.parse_args()
    if args.llamacpp is not None and not args.llamacpp.is_file():
        parser.error(f"--llamacpp {args.llamacpp}: no such file")
    llama = None if args.llamacpp is None else llama_python()
    if llama is not None and not llama.is_file():
        parser.error(f"no llama.cpp venv at {llama}: run scripts/bench_vs_llamacpp.py once "
                     "(it makes it) or set ONNX_CHUNK_LLAMACPP_PYTHON")
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
    for system in args.folders:
        if not Path(split_arm(system)[0]).is_dir():
            parser.error(f"{system}: no such folder (FOLDER or FOLDER+NAME=VALUE)")
    genai = None if args.genai is None else env.genai_python(args.genai_venv)
    prompt_file = _prompt_file(Path(split_arm(args.folders[0])[0]), args.positions)
    systems = [*args.folders, *([] if args.genai is None else [f"genai:{args.genai}"])]
    results: dict[str, list[float]] = {system: [] for system in systems}
    prefills: dict[str, list[float]] = {system: [] for system in systems}
    try:
        for _ in range(args.rounds):
            for system in systems:
                if genai is not None and system.startswith("genai:"):
                    got = {**_genai_child(genai, str(args.genai), prompt_file, args.positions),
                           "kv_dtype": "genai"}
                else:
                    folder, environment = split_arm(system)
                    got = _child({"mode": "decode", "folder": folder,
                                  "prompt_file": prompt_file,
                                  "environment": sorted(environment)}, environment)
                    if got["environment"] != environment:  # the child saw what it was given
                        raise SystemExit(f"error: {system}: the child's environment was "
                                         f"{got['environment']}")
                results[system].append(got["tokens_per_s"])
                prefills[system].append(got["prefill_s"])
                print(f"{args.positions:>6} {got['kv_dtype']:>8} {got['tokens_per_s']:7.2f} "
                      f"tok/s  prefill {got['prefill_s']:.2f} s  load {_load()}  "
                      f"{_label(system)}", flush=True)
                time.sleep(1)
    finally:
        os.unlink(prompt_file)
    for system, values in results.items():
        prefill = prefills[system]
        print(f"median {statistics.median(values):7.2f} tok/s (spread "
              f"{min(values):.2f}-{max(values):.2f}), prefill {statistics.median(prefill):.2f} s "
              f"(spread {min(prefill):.2f}-{max(prefill):.2f})  {_label(system)}")

if __name__ == "__main__":
    main()
