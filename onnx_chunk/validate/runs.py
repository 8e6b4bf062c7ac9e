"""Running seeded prompts through the runtime and keeping only the rows the checks compare.

A prompt's logits are never kept whole: a reference run keeps its last prompt row (from one
forward of the whole prompt) and each chunk boundary's row (from one forward of the prefix that
ends there), a chunked run keeps the last row of each of its chunks, and both keep the decode
steps' rows. So what a run holds is a few rows of the vocabulary plus its KV prefix, whatever
the prompt length.

Every free-running generation here is a request on the engine's step (`greedy_generation`),
with the runtime's greedy sampler and finish rule; validate never chooses a token it feeds.
Teacher-forced runs (fed tokens a generation chose) score rows with the sequence's forward
primitives, and their own choice at a row is the runtime's greedy sampler's (`greedy_choice`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_chunk.errors import ModelLoadError, OnnxChunkError
from onnx_chunk.runtime import Runtime, Sequence, load
from onnx_chunk.runtime.device.buffers import SequenceBuffers
from onnx_chunk.runtime.engine.kv_window import resident_rows
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.sampling import GREEDY, Sampler, Sampling
from onnx_chunk.validate.prompts import seeded_prompt

Advance = Callable[[str], None]


@dataclass(frozen=True)
class RunSettings:
    """How the dynamic decoder is exercised: one setting per option, resolved once.

    `atol` is the base tolerance (the provider's default, or `--atol` when `atol_given`);
    `margin` multiplies the kernels' measured noise floor (numerics); `tiers`: the ladder a
    runtime at `chunk_size` pads to; `exact`: every runtime in exact mode, compared bit for bit;
    `threads`: ONNX Runtime's intra-op threads of every session (None: its default).
    """

    provider: str
    capacity: int
    chunk_size: int
    lengths: tuple[int, ...]
    new_tokens: int
    seed: int
    atol: float
    atol_given: bool = False
    margin: float = 4.0
    tiers: tuple[int, ...] = ()
    exact: bool = False
    threads: int | None = None


@dataclass(frozen=True)
class PromptRun:
    """One prompt through one runtime, reduced to what is compared.

    `rows` maps a prompt row index to its logits [vocab]: every chunk boundary's last row and
    the prompt's last row. `decode` holds each decode step's logits [vocab], `tokens` the greedy
    token of the last prompt row and of every decode step (a chunked run is fed the reference's
    tokens, so its decode rows stay comparable; its `tokens` are the runtime's greedy choice at
    its own rows), `margins` the top-1 minus top-2 logit at each of those. `kv` holds each KV
    buffer's valid prefix, then each recurrent state.
    """

    length: int
    tokens: tuple[int, ...]
    margins: tuple[float, ...]
    rows: dict[int, np.ndarray]
    decode: tuple[np.ndarray, ...]
    kv: tuple[np.ndarray, ...]


def load_runtime(model_path: Path, settings: RunSettings, *, chunk_size: int,
                 padding: bool | None, max_batch: int = 1,
                 graph: bytes | None = None) -> Runtime:
    """A runtime of the model with the provider's own sessions, as `serve` loads it
    (per-width variants on CUDA, one shape-generic session on CPU); `graph`: an edited copy
    of its graph to run instead."""
    return load(model_path, provider=settings.provider, capacity=settings.capacity,
                chunk_size=chunk_size, padding=padding, max_batch=max_batch, graph=graph,
                exact=settings.exact, intra_op_threads=settings.threads)


def boundaries(length: int, chunk_size: int) -> list[int]:
    """The prompt rows that end a chunk at width `chunk_size` (the runtime's own schedule),
    the last row included."""
    return [end - 1 for _, end in prefill_chunks(length, chunk_size)]


def reference_run(runtime: Runtime, length: int, settings: RunSettings) -> PromptRun:
    """The unchunked run of a seeded prompt: its greedy generation on `runtime` (chunk =
    capacity: one forward of the whole prompt, then the decode steps; `greedy_generation`),
    and one forward per chunk boundary of the prefix ending there (the boundary row's
    unchunked logits, a last row again)."""
    ids = seeded_prompt(runtime.stats.vocab_size, length, settings.seed)
    with runtime.open_sequence() as sequence:
        generation = greedy_generation(sequence, ids, settings.new_tokens)
        kv = kv_snapshot(runtime, sequence.buffers, sequence.length)
    last, *decode = generation.rows
    rows = {length - 1: last}
    for row in boundaries(length, settings.chunk_size)[:-1]:
        with runtime.open_sequence() as sequence:
            rows[row] = sequence.prefill(ids[:row + 1])
    return PromptRun(length, generation.tokens, tuple(map(margin, generation.rows)), rows,
                     tuple(decode), kv)


def chunked_run(runtime: Runtime, reference: PromptRun, settings: RunSettings) -> PromptRun:
    """The seeded prompt fed chunk by chunk at the runtime's width (each chunk's last row kept),
    then teacher-forced on the reference's tokens, with the runtime's greedy choice at each of
    its rows recorded (never fed)."""
    ids = seeded_prompt(runtime.stats.vocab_size, reference.length, settings.seed)
    rows: dict[int, np.ndarray] = {}
    with runtime.open_sequence() as sequence:
        for begin, end in prefill_chunks(len(ids), runtime.stats.chunk_size):
            rows[end - 1] = sequence.prefill(ids[begin:end])
        decode = tuple(sequence.decode(fed) for fed in reference.tokens[:-1])
        kv = kv_snapshot(runtime, sequence.buffers, sequence.length)
    scored = (rows[len(ids) - 1], *decode)
    choose = greedy_choice(runtime.stats.vocab_size)
    return PromptRun(reference.length, tuple(map(choose, scored)), tuple(map(margin, scored)),
                     rows, decode, kv)


@dataclass(frozen=True)
class Generation:
    """A free-running greedy generation: its tokens and the logits row [vocab] each was chosen
    from (the prompt's last row, then each decode step's)."""

    tokens: tuple[int, ...]
    rows: tuple[np.ndarray, ...]


def greedy_generation(sequence: Sequence, ids: np.ndarray, new_tokens: int) -> Generation:
    """`new_tokens` greedy tokens of `ids` generated as every generation is: one request on the
    engine's step (`Sequence.generate`), the runtime's sampler and finish rule, no stop id. The
    sequence then holds the prompt and every token but the last.

    The step gives its caller tokens, not logits; the rows come from a grammar that allows
    every token and keeps the row it is shown before each choice (a `Sampler` applies a
    grammar first, to the raw logits): the very numbers the sampler chose from, at no forward
    more. ModelLoadError when a row has no finite maximum (NaN or infinities): no token can be
    chosen from it.
    """
    observed = _Observed()
    try:
        tokens = sequence.generate(ids, new_tokens, (), sampling=Sampling(constraint=observed))
    except OnnxChunkError:
        raise
    except ValueError as error:  # the sampler's refusal of a row it cannot choose from
        raise ModelLoadError(f"no token can be chosen on a prompt of {len(ids)} tokens: "
                             f"{error}") from error
    rows = observed.rows
    assert len(rows) == len(tokens)  # one row shown per token chosen
    return Generation(tuple(tokens), tuple(rows))


def greedy_choice(vocab_size: int) -> Callable[[np.ndarray], int]:
    """The runtime's greedy choice of a logits row (a `Sampler` under greedy `Sampling`): what a
    generation would choose there. Validate reads it off teacher-forced rows, never feeds it."""
    return Sampler(GREEDY, vocab_size).choose


class _Observed:
    """A grammar (`sampling.Constraint`) that allows every token: its matcher keeps each row
    the sampler shows it, as float32 (exact for the float32 and float16 logits decoders
    return)."""

    def __init__(self) -> None:
        self._matchers: list[_Observer] = []

    def matcher(self) -> _Observer:
        matcher = _Observer()
        self._matchers.append(matcher)
        return matcher

    @property
    def rows(self) -> list[np.ndarray]:
        """The rows of each token chosen, in order (one request: one matcher)."""
        return [row for matcher in self._matchers for row in matcher.rows]


class _Observer:
    """One request's matcher: a row is kept when a token is chosen from it (`advance`)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self._shown: np.ndarray | None = None

    def restrict(self, scores: np.ndarray) -> None:
        self._shown = scores.astype(np.float32)

    def advance(self, token: int) -> None:
        assert self._shown is not None  # a sampler shows the row before it chooses
        self.rows.append(self._shown)
        self._shown = None


def generate_prompt(runtime: Runtime, length: int, settings: RunSettings) -> list[int]:
    """Greedy generation of a seeded prompt through the runtime's `generate` (a served request)."""
    ids = seeded_prompt(runtime.stats.vocab_size, length, settings.seed)
    with runtime.open_sequence() as sequence:
        return sequence.generate(ids, settings.new_tokens)


def prefix_forward(runtime: Runtime, ids: np.ndarray, *, every: bool) -> tuple[
        np.ndarray, list[np.ndarray]]:
    """One forward of `ids` from an empty cache: the logits (every row's [rows, vocab] with
    `every`, else the row the decoder returns last [vocab]) and the KV it wrote, each buffer's
    positions moved to the leading axis (recurrent states, which hold no positions, are left
    out)."""
    with runtime.open_sequence() as sequence:
        logits = sequence.prefill(ids, all_logits=every)
        kv = kv_snapshot(runtime, sequence.buffers, sequence.length)
        axes = {binding.input: binding.capacity_axis
                for binding in runtime.debug.plan.capacity_inputs}
        ports = sequence.buffers.kv_ports
        return logits, [np.moveaxis(array, axes[port.input], 0)
                        for port, array in zip(ports, kv)]


def margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row."""
    top = np.partition(np.asarray(logits, dtype=np.float64).reshape(-1), -2)[-2:]
    return float(top[1] - top[0])


def kv_snapshot(runtime: Runtime, buffers: SequenceBuffers, length: int) -> tuple[np.ndarray, ...]:
    """Each KV buffer's valid prefix of `length` positions (a window's resident rows), then
    each recurrent state, as host copies."""
    axes = {binding.input: binding.capacity_axis for binding in runtime.debug.plan.capacity_inputs}
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
