"""What one served chat request runs: the onnx_chunk modules on its path and the threads it
starts.

The model is served as `onnx-chunk serve` serves it (the app under uvicorn, in this process,
on a free loopback port). After a warm-up request, one streamed and one whole chat completion
run with a profiler on every thread (`sys.setprofile` and `threading.setprofile`): each Python
function call is attributed to its module, and `threading.Thread.start` is counted. Printed:
the threads started, the onnx_chunk modules entered (with their calls), and the other packages
entered.

    .venv/bin/python scripts/trace_request.py [MODEL] [--max-tokens 4]

MODEL: a model folder with a tokenizer and a chat template (default the corpus's
genai-qwen3-fp32 export).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"


def _module_of(filename: str) -> str | None:
    path = Path(filename)
    parts = path.with_suffix("").parts
    if "onnx_chunk" in parts:
        return ".".join(parts[len(parts) - 1 - parts[::-1].index("onnx_chunk"):])
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].split(".")[0]
    return None


def _chat(url: str, body: dict) -> bytes:
    connection = http.client.HTTPConnection(url, timeout=120)
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise SystemExit(f"error: the server answered {response.status}: {data[:200]!r}")
        return data
    finally:
        connection.close()


def trace(model: Path, max_tokens: int) -> dict:
    from onnx_chunk import load
    from onnx_chunk.serve import create_app
    from onnx_chunk.serve.server import DrainingServer, bind

    calls: collections.Counter[str] = collections.Counter()
    started: list[str] = []
    tracing = threading.Event()

    def profile(frame, event, arg):  # noqa: ARG001  (sys.setprofile's signature)
        if event == "call" and tracing.is_set():
            module = _module_of(frame.f_code.co_filename)
            if module is not None:
                calls[module] += 1

    start = threading.Thread.start

    def counted(self):
        if tracing.is_set():
            started.append(self.name)
        return start(self)

    with load(model, provider="cpu", max_batch=2) as runtime:
        listener = bind("127.0.0.1", 0)
        server = DrainingServer(create_app(runtime))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                                  daemon=True)
        threading.setprofile(profile)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        url = f"127.0.0.1:{listener.getsockname()[1]}"
        body = {"messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": max_tokens}
        _chat(url, body)  # warm-up: the engine thread and the server's first request
        threading.Thread.start = counted  # type: ignore[method-assign]
        sys.setprofile(profile)
        try:
            tracing.set()
            _chat(url, {**body, "stream": True})
            _chat(url, body)
            tracing.clear()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            threading.Thread.start = start  # type: ignore[method-assign]
            server.stop()
            thread.join(30)
            listener.close()
    ours = {name: count for name, count in calls.items() if name.startswith("onnx_chunk")}
    others = {name: count for name, count in calls.items() if name not in ours}
    return {"threads_started": started, "onnx_chunk_modules": dict(sorted(ours.items())),
            "other_packages": dict(sorted(others.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if not args.model.exists():
        parser.error(f"no model at {args.model}")
    result = trace(args.model, args.max_tokens)
    print(f"threads started by two requests (streamed, whole): {len(result['threads_started'])}"
          f" {result['threads_started']}")
    print(f"onnx_chunk modules on the path: {len(result['onnx_chunk_modules'])}")
    for name, count in result["onnx_chunk_modules"].items():
        print(f"  {name}: {count} calls")
    print("other packages: " + ", ".join(result["other_packages"]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
