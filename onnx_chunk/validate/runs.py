"""Running seeded prompts through the runtime and keeping what the numerics checks compare."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_chunk.runtime import Runtime, load
from onnx_chunk.runtime.device.buffers import SequenceBuffers
from onnx_chunk.runtime.engine.kv_window import resident_rows
from onnx_chunk.validate.prompts import seeded_prompt

Advance = Callable[[str], None]


@dataclass(frozen=True)
class RunSettings:
    """How the dynamic decoder is exercised: one setting per option, resolved once."""

    provider: str
    capacity: int
    chunk_size: int
    lengths: tuple[int, ...]
    new_tokens: int
    seed: int
    atol: float


@dataclass(frozen=True)
class PromptRun:
    """One prompt through one runtime: greedy tokens, the logits rows, the KV prefix and state.

    `logits` holds the prompt rows ([rows, vocab]; only the last row when the decoder returns
    the last row only), then one [1, vocab] array per decode step, never concatenated.
    `kv` holds each KV buffer's valid prefix, then each recurrent state. A run is as large as
    its prompt times the vocabulary: compare it and let it go, never keep runs.
    """

    length: int
    tokens: tuple[int, ...]
    logits: tuple[np.ndarray, ...]
    kv: tuple[np.ndarray, ...]


def load_runtime(model_path: Path, settings: RunSettings, *, chunk_size: int,
                 padding: bool | None) -> Runtime:
    """A runtime for one validation mode, always with per-width variants.

    Per-width variants are what pads and what a cache can thrash (the CUDA default); the CPU
    provider's default, one shape-generic session, has neither. Every mode uses them, so the
    whole, chunked and padded runs are compared on the same kind of sessions.
    """
    return load(model_path, provider=settings.provider, capacity=settings.capacity,
                chunk_size=chunk_size, padding=padding, specialize=True)


def run_prompt(runtime: Runtime, length: int, settings: RunSettings) -> PromptRun:
    """Prefill a seeded prompt of `length` tokens, then decode greedily; keep what is compared."""
    ids = seeded_prompt(runtime.ports.vocab_size, length, settings.seed)
    sequence = runtime.open_sequence()
    every_row = not runtime.ports.last_row_logits
    prompt_logits = sequence.prefill(ids, all_logits=every_row)
    rows = [prompt_logits if every_row else prompt_logits[None]]
    token = int(np.argmax(rows[0][-1]))
    tokens = [token]
    for _ in range(settings.new_tokens - 1):
        logits = sequence.decode(token)
        rows.append(logits[None])
        token = int(np.argmax(logits))
        tokens.append(token)
    return PromptRun(length, tuple(tokens), tuple(rows),
                     _kv_snapshot(runtime, sequence.buffers, sequence.length))


def generate_prompt(runtime: Runtime, length: int, settings: RunSettings) -> list[int]:
    """Greedy generation of a seeded prompt through the runtime's `generate` (a served request)."""
    ids = seeded_prompt(runtime.ports.vocab_size, length, settings.seed)
    return runtime.open_sequence().generate(ids, settings.new_tokens)


def _kv_snapshot(runtime: Runtime, buffers: SequenceBuffers, length: int) -> tuple[np.ndarray, ...]:
    axes = {binding.input: binding.capacity_axis for binding in runtime.plan.capacity_inputs}
    arrays = []
    for port, buffer in zip(buffers.kv_ports, buffers.kv):
        host = buffer.host if buffer.host is not None else buffer.value.numpy()
        axis = axes[port.input]
        rows = np.arange(length)
        if port.window is not None:
            # A window-sized cache holds its most recent positions from row 0 (kv_window), as
            # many as its capacity allows: compare the window's worth that every capacity holds.
            held = resident_rows(length, host.shape[axis], port.window)
            rows = np.arange(held - min(length, port.window), held)
        arrays.append(np.take(host, rows, axis=axis).copy())
    for index in range(len(buffers.state_ports)):
        buffer = buffers.state(index)
        host = buffer.host if buffer.host is not None else buffer.value.numpy()
        arrays.append(np.array(host, copy=True))
    return tuple(arrays)
