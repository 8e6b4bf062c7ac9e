"""An answer too large for --max-answer-bytes is refused from the request alone, before any
forward: at once, with its numbers right and the field to lower named, and with no memory kept
by the server process (`onnx-chunk serve` as a subprocess, its VmRSS read from /proc)."""

from __future__ import annotations

import http.client
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from onnx_chunk.serve.answer_size import ENTRY_BYTES
from tests.serve.conftest import EXPORT

# Above what the old 8-bytes-an-entry check refused (10,752,000 bytes for this request), below
# its answer (about 38 MB on this export): the request that once ran its forwards first.
LIMIT = 16_000_000
PROMPTS, LENGTH, TOP = 32, 2000, 20


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def _post(connection: http.client.HTTPConnection, path: str, body: bytes
          ) -> tuple[int, dict, float]:
    start = time.perf_counter()
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    return response.status, answer, time.perf_counter() - start


def _requests_served(connection: http.client.HTTPConnection) -> float:
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("onnx_chunk_requests_total{"))


def test_an_oversized_answer_is_refused_at_once_and_keeps_no_memory():
    server = subprocess.Popen(
        [sys.executable, "-m", "onnx_chunk", "serve", str(EXPORT), "--provider", "cpu",
         "--port", "0", "--max-answer-bytes", str(LIMIT)], stderr=subprocess.PIPE, text=True)
    try:
        address = re.search(r"http://(\S+:\d+)", server.stderr.readline()).group(1)
        connection = http.client.HTTPConnection(address, timeout=60)
        prompts = [[(prompt + index) % 250 for index in range(LENGTH)]
                   for prompt in range(PROMPTS)]
        body = json.dumps({"prompt": prompts, "echo": True, "logprobs": TOP,
                           "max_tokens": 0}).encode()
        status, answer, _ = _post(connection, "/v1/completions", body)  # warm-up
        assert status == 400, answer
        error = answer["error"]
        entries = PROMPTS * LENGTH * (1 + TOP)
        assert (error["code"], error["param"]) == ("answer_too_large", "logprobs")
        least = entries * ENTRY_BYTES["completion"]
        assert f"at least {least} bytes" in error["message"] and least > LIMIT
        assert f"the {LIMIT} bytes" in error["message"]
        before = _rss_kib(server.pid)
        seconds = []
        for _ in range(5):
            status, _, elapsed = _post(connection, "/v1/completions", body)
            assert status == 400
            seconds.append(elapsed)
        grown = _rss_kib(server.pid) - before
        assert statistics.median(seconds) < 0.1, seconds
        # One answer kept would be more than LIMIT (16 MB); parsing five 0.3 MB bodies can leave
        # the allocator's arenas about 1 MiB larger (1056 KiB seen under load).
        assert grown < 4096, f"the server's resident set grew by {grown} KiB"
        assert _requests_served(connection) == 0  # nothing was queued
    finally:
        server.terminate()
        server.wait(timeout=30)
