"""Generation on a pair of static decoders: a chunk graph (rows c) and a decode graph
(rows 1) that share weights and the KV capacity C.

As a pipeline: align the prompt (pad / left truncate to whole chunks), run its chunks in order,
then decode one row at a time on the same cache. Every forward goes through the runtime's one
interface, `ForwardRunner.run(slot, Forward) -> Ran`, as `ModelRunner`'s do: a `GraphRunner`
per graph takes the real rows of one chunk (or one decode token) on the request's `StaticSlot`
(cache, valid positions, length), widens them to the graph's rows on the layout's side with
`pad_rows`, the rule `align_prompt` pads by (so its `padded_rows` add up to the prompt's
pad_count), and returns the last real row's logits. The tokens come from the runtime's one
generation loop: a lone engine (`batch_engine.lone_engine`) over the request's slot, whose
step takes the prefill's logits as its prompt's one chunk (those forwards ran, chunk by chunk,
in `run_prefill`) and runs each decode step on the decode graph; its scheduler chooses every
token with the request's `Sampler` (greedy by default) and ends the generation by the one
finish rule (`request.finish_reason`). What the static shapes cost is reported in the result,
never hidden: tokens truncated away, padding added, real positions dropped past C.

The graphs and their forwards: `graphs`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnx_chunk import arguments
from onnx_chunk.errors import (
    CapacityError,
    ConfigError,
    ModelStructureError,
    ProviderError,
)
from onnx_chunk.runtime.device.provider import Device, resolve_device
from onnx_chunk.runtime.engine.batch_engine import lone_engine
from onnx_chunk.runtime.engine.request import CheckedRequest, FinishReason
from onnx_chunk.runtime.runner.forward import Forward, ForwardRunner, Ran, Row
from onnx_chunk.sampling import Sampling
from onnx_chunk.static.alignment import (
    AlignedPrompt,
    StaticLimits,
    align_prompt,
)
from onnx_chunk.static.graphs import (
    CacheLayout,
    GraphRunner,
    StaticLength,
    StaticSlot,
    graph_spec,
    metadata_int,
    open_session,
    window_capacity_problem,
)
from onnx_chunk.static.kv_buffers import StaticKVBuffers

logger = logging.getLogger(__name__)


@dataclass
class StaticGenerationResult:
    """Generated tokens and what the static shapes did to the request."""

    tokens: list[int]
    prompt_len: int
    aligned_len: int
    pad_count: int
    truncated_tokens: int
    """Prompt tokens left-truncated to fit the max input length L (lost context)."""
    dropped_positions: int
    """Real positions that fell off the rolling cache (the cache became a sliding window)."""
    chunks: int
    decode_steps: int
    ttft_s: float
    """Seconds from the call to the first generated token (alignment and chunked prefill)."""
    decode_tokens_per_s: float | None
    """Tokens per second of the decode steps after the first token; None without any."""
    finish_reason: FinishReason
    """Why it ended: "stop" (an end-of-sequence id came) or "length" (max_new_tokens)."""
    warnings: list[str] = field(default_factory=list)
    step_logits: list[np.ndarray] = field(default_factory=list)
    """The logits [vocab] each token was chosen from, when asked for (`keep_logits`)."""


@dataclass
class StaticPrefill:
    """A prompt after chunked prefill: the cache it filled and the first token's logits."""

    aligned: AlignedPrompt
    slot: StaticSlot
    """The request's cache, valid positions and length, which decode goes on from."""
    logits: np.ndarray
    """The last real row's logits [vocab]: they give the first generated token."""
    chunks: int
    began: float
    """`time.perf_counter()` when the request started (for the time to first token)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def cache(self) -> StaticKVBuffers:
        return self.slot.cache


class StaticRunner:
    """Runs a chunk graph (rows c) and a decode graph (rows 1) of one static decoder.

    `max_input_len` is L, the longest aligned prompt; by default the largest multiple of c below
    C. `provider` is "auto", "cuda" or "cpu" (`resolve_device`, shared with the dynamic
    runtime); `device`, a resolved `Device`, replaces provider and device_id (for example the
    CPU device marked not host-visible, which runs the device-memory path on CPU). `strict`
    refuses (CapacityError) any request that would lose context, by
    truncation or by the cache sliding, instead of warning.
    """

    def __init__(
        self,
        chunk_model: str | os.PathLike,
        decode_model: str | os.PathLike,
        *,
        max_input_len: int | None = None,
        provider: str = "auto",
        device_id: int = 0,
        strict: bool = False,
        device: Device | None = None,
    ) -> None:
        chunk_path, decode_path = Path(chunk_model), Path(decode_model)
        self.device = device if device is not None else resolve_device(provider, device_id)
        self.chunk_session = open_session(chunk_path, self.device)
        self.decode_session = open_session(decode_path, self.device)
        self.chunk_spec = graph_spec(self.chunk_session, chunk_path)
        self.decode_spec = graph_spec(self.decode_session, decode_path)
        chunk, decode = self.chunk_spec, self.decode_spec
        if decode.rows != 1:
            raise ModelStructureError(
                f"the decode graph {decode_path} takes {decode.rows} rows; it must take 1 "
                f"(build it with chunk_size=1)"
            )
        cache = [(spec.capacity, spec.num_layers, spec.kv_heads, spec.head_width,
                  spec.kv_dtype_name) for spec in (chunk, decode)]
        if cache[0] != cache[1]:
            raise ModelStructureError(
                f"the chunk and decode graphs disagree on the cache: capacity/layers/kv heads/"
                f"head width/type {'/'.join(map(str, cache[0]))} against "
                f"{'/'.join(map(str, cache[1]))}; build both with the same capacity from one "
                f"model"
            )
        if chunk.layout is not decode.layout:
            raise ModelStructureError(
                f"the chunk graph {chunk_path} has the {chunk.layout.value} cache layout but "
                f"the decode graph {decode_path} the {decode.layout.value} one; use the decode "
                f"graph written with the chunk graph"
            )
        self.layout = chunk.layout
        windows = _windows(chunk_path)
        problem = window_capacity_problem(windows, chunk.capacity, self.device)
        if problem is not None:
            raise ProviderError(f"{chunk_path}: {problem}")
        if max_input_len is None:
            max_input_len = (chunk.capacity - 1) // chunk.rows * chunk.rows
            if max_input_len == 0:
                raise ConfigError(
                    f"chunk size c={chunk.rows} with capacity C={chunk.capacity} leaves no "
                    f"aligned prompt length below C; build the chunk graph with c < C"
                )
        self.limits = StaticLimits(max_input_len, chunk.rows, chunk.capacity)
        self.strict = strict
        self.pad_token_id = metadata_int(self.chunk_session, "pad_token_id") or 0
        self.max_positions = metadata_int(self.chunk_session, "max_positions")
        self.vocab_size = int(self.chunk_session.get_outputs()[0].shape[-1])
        # Every forward runs through one of them: the prompt's chunks, then the decode steps.
        self._chunks: ForwardRunner[StaticSlot] = GraphRunner(
            self.chunk_session, chunk, self.device, pad_id=self.pad_token_id,
            vocab_size=self.vocab_size)
        self._steps: ForwardRunner[StaticSlot] = GraphRunner(
            self.decode_session, decode, self.device, pad_id=self.pad_token_id,
            vocab_size=self.vocab_size)

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type, named as `RuntimeStats.kv_dtype` names it."""
        return self.chunk_spec.kv_dtype_name

    @property
    def kv_bytes(self) -> int:
        """What one request's KV cache holds at the capacity C, in bytes (as
        `RuntimeStats.kv_bytes` counts one sequence's)."""
        return self.chunk_spec.kv_bytes

    def check_request(self, aligned: AlignedPrompt, max_new_tokens: int) -> None:
        """Refuse requests the graphs cannot serve, before running anything."""
        max_new_tokens = arguments.integer(max_new_tokens, "max_new_tokens", minimum=1)
        last_position = aligned.kept_len + max_new_tokens - 2
        if self.max_positions is not None and last_position >= self.max_positions:
            raise CapacityError(
                f"generation would reach position {last_position} but the model's rotary cache "
                f"holds {self.max_positions} positions; generate fewer tokens"
            )
        cached = aligned.kept_len + max_new_tokens - 1
        if self.layout is CacheLayout.BOUND and cached > self.limits.capacity:
            raise CapacityError(
                f"{aligned.kept_len} prompt tokens + {max_new_tokens - 1} fed-back tokens need "
                f"{cached} cache positions but the capacity is C={self.limits.capacity}, and a "
                f"cache bound at capacity (GroupQueryAttention) cannot slide: generate at most "
                f"{self.limits.capacity - aligned.kept_len + 1} tokens or fix the shapes with a "
                f"larger capacity"
            )
        if self.strict and cached > self.limits.capacity:
            raise CapacityError(
                f"{aligned.kept_len} prompt tokens + {max_new_tokens - 1} fed-back tokens need "
                f"{cached} cache positions but the capacity is C={self.limits.capacity}; the "
                f"oldest context would be dropped: raise C (C = L + max_new_tokens) or generate "
                f"fewer tokens"
            )

    def new_cache(self) -> StaticKVBuffers:
        """An empty KV cache of the graphs' layout."""
        spec = self.chunk_spec
        return self.layout.cache_type(spec.num_layers, spec.kv_heads, spec.capacity,
                                      spec.head_width, dtype=spec.kv_dtype, device=self.device)

    def prefill(self, aligned: AlignedPrompt, slot: StaticSlot) -> tuple[np.ndarray, int]:
        """Run the aligned prompt chunk by chunk on `slot`, each chunk a forward of its real
        rows (padded back to c by the chunk graph's runner); returns the last real row's logits
        and the number of chunks run."""
        rows = self.limits.chunk_size
        chunks = aligned.aligned_len // rows
        ran = None
        for index in range(chunks):
            window = slice(index * rows, (index + 1) * rows)
            real = aligned.input_ids[window][aligned.valid[window]]
            ran = self._chunks.run(slot, Forward([Row(real, slot.length)],
                                                 "last" if index == chunks - 1 else "none"))
        assert ran is not None and ran.logits is not None
        return ran.logits[0], chunks

    def start(
        self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int
    ) -> StaticPrefill:
        """Check the request, align the prompt and run its chunks on a fresh cache."""
        began = time.perf_counter()
        return self.run_prefill(self.align(prompt_ids, max_new_tokens), began)

    def align(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int
              ) -> AlignedPrompt:
        """Check a request and align its prompt, running nothing: InputError for ids outside
        the vocabulary, CapacityError / ConfigError for what the graphs cannot serve."""
        ids = arguments.prompt_ids(prompt_ids, self.vocab_size)
        aligned = align_prompt(ids, self.limits, pad_id=self.pad_token_id, strict=self.strict,
                               pad_side=self.layout.pad_side)
        self.check_request(aligned, max_new_tokens)
        return aligned

    def run_prefill(self, aligned: AlignedPrompt, began: float | None = None) -> StaticPrefill:
        """Run an aligned, checked prompt (`align`) chunk by chunk on a fresh cache; `began`
        is when the request started (default now), for the time to first token."""
        began = time.perf_counter() if began is None else began
        warnings = []
        if aligned.truncated_count:
            warnings.append(
                f"prompt left-truncated by {aligned.truncated_count} of {aligned.prompt_len} "
                f"tokens to fit L={self.limits.max_input_len}"
            )
        slot = StaticSlot(self.new_cache(), StaticLength(self.limits.capacity))
        logits, chunks = self.prefill(aligned, slot)
        return StaticPrefill(aligned, slot, logits, chunks, began, warnings)

    def decode(
        self, prefill: StaticPrefill, max_new_tokens: int, *,
        eos_token_id: int | Sequence[int] | None = None, sampling: Sampling | None = None,
        keep_logits: bool = False,
    ) -> StaticGenerationResult:
        """The tokens after `start`: the first from the prefill's logits, the rest one row at a
        time through the decode graph on the same cache (which this call rolls on).

        Each token is chosen by a `Sampler` under `sampling` (default greedy: the argmax),
        which first sees the prompt's kept real ids, as a dynamic sequence's does. The
        generation ends by the requests' one rule (`finish_reason`): at an id of
        `eos_token_id` (one id or several, each in [0, vocab); None: none) or after
        `max_new_tokens`. `keep_logits` keeps the logits of every step in the result.
        """
        checked = self._checked(prefill.aligned, max_new_tokens, eos_token_id, sampling)
        return self._decode(prefill, checked, keep_logits)

    def _checked(self, aligned: AlignedPrompt, max_new_tokens: int, eos_token_id: object,
                 sampling: Sampling | None) -> CheckedRequest:
        """The request of an aligned prompt, checked as the dynamic runtime checks one
        (`CheckedRequest.check`: its sampler sees the prompt's kept ids); the static runner
        gives tokens only, and `check_request` checked its capacity."""
        return CheckedRequest.check(
            aligned.input_ids[aligned.valid], max_new_tokens, eos_token_id, sampling,
            vocab=self.vocab_size,
            tokens_only="the static runner gives tokens only; ask for logprobs from a "
                        "dynamic model (Runtime.submit or generate_text)")

    def _decode(self, prefill: StaticPrefill, checked: CheckedRequest,
                keep_logits: bool) -> StaticGenerationResult:
        """The request's tokens from the engine's step (see the module docstring): the first
        from the prefill's logits, then a decode graph forward per token."""
        aligned, slot = prefill.aligned, prefill.slot
        step_logits = [prefill.logits] if keep_logits else []

        def decode(token: int) -> np.ndarray:
            ran = self._steps.run(slot, Forward([Row(np.array([token], dtype=np.int64),
                                                     slot.length)]))
            assert ran.logits is not None  # a decode forward asks for its row's logits
            if keep_logits:
                step_logits.append(ran.logits[0])
            return ran.logits[0]

        engine = lone_engine(_Prefilled(prefill.logits), slot, slot.length,
                             chunk_size=len(checked.prompt), speculation=None)
        engine.runner.decode = decode
        request = engine.submit(checked)
        ttft, decode_began = 0.0, 0.0
        try:
            while not request.done:
                engine.step()
                if not ttft and request.produced:
                    decode_began = time.perf_counter()
                    ttft = decode_began - prefill.began
        finally:
            engine.release()
        tokens = request.result()  # the error of a forward that failed, raised here
        reason = request.finish_reason
        assert reason is not None  # it ended
        steps = len(tokens) - 1  # every token after the first came from a decode forward
        decode_s = time.perf_counter() - decode_began
        warnings = list(prefill.warnings)
        dropped = slot.cache.dropped_positions
        if dropped:
            warnings.append(
                f"{dropped} real positions dropped off the KV cache of capacity "
                f"C={self.limits.capacity}: attention became a sliding window"
            )
            logger.warning("%s", warnings[-1])
        return StaticGenerationResult(
            tokens=tokens, prompt_len=aligned.prompt_len, aligned_len=aligned.aligned_len,
            pad_count=aligned.pad_count, truncated_tokens=aligned.truncated_count,
            dropped_positions=dropped, chunks=prefill.chunks, decode_steps=steps,
            ttft_s=ttft, decode_tokens_per_s=steps / decode_s if steps and decode_s > 0 else None,
            finish_reason=reason, warnings=warnings, step_logits=step_logits,
        )

    def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: Sampling | None = None,
    ) -> StaticGenerationResult:
        """Tokens for `prompt_ids`: chunked prefill, then single-row decode steps, chosen and
        ended as `decode` says. The request is checked before anything runs."""
        began = time.perf_counter()
        aligned = self.align(prompt_ids, max_new_tokens)
        checked = self._checked(aligned, max_new_tokens, eos_token_id, sampling)
        return self._decode(self.run_prefill(aligned, began), checked, keep_logits=False)


class _Prefilled:
    """A static request's forwards on its lone engine (`plan_runner.Forwards`), once
    `run_prefill` ran its prompt chunk by chunk: the engine's one chunk of that prompt gives
    the prefill's last logits (its forwards ran; nothing runs again, the slot's length already
    counts the prompt). The decode steps run on the engine's pinned decode step."""

    batches_chunks = False

    def __init__(self, logits: np.ndarray) -> None:
        self._logits: np.ndarray | None = logits

    def chunk_width(self, rows: int, room: int) -> int:
        return rows

    def run(self, slot: object, forward: Forward) -> Ran:
        if self._logits is None:
            raise ValueError("a static request's prompt is given to its engine once")
        logits, self._logits = self._logits, None
        return Ran(logits[None], forward.width, 0)


def _windows(chunk_path: Path) -> set[int]:
    """The sliding windows of the chunk graph's KV inputs, read by the passes' analysis (which
    imports onnx_ir: only a static model being opened pays for it)."""
    from onnx_chunk.graph.model_io import load_model
    from onnx_chunk.passes.kv_capacity import find_kv_capacity

    return {binding.window for binding in find_kv_capacity(load_model(chunk_path)).bindings
            if binding.window is not None}
