"""A loaded decoder: its plan, device, shared weights and variant cache; sequences open on it.

`load(path)` takes a model file or a folder (as onnxruntime-genai does; see
onnx_chunk.graph.model_folder), reads the chunked-prefill plan, the ports and the external data
index from the file's protobuf (`loading`, `model_file`: a converted model loads without onnx
or onnx_ir; an unconverted one runs the passes in memory) and the genai_config.json that applies,
resolves the options once (`options`), loads the weights once and sets up the variant cache.
`Runtime.open_sequence()` gives independent sequences that share all of it. Its parts are
private: users read `Runtime.stats`, tests and diagnosis `Runtime.debug`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from onnx_chunk._onnxruntime_wheels import check_one_wheel
from onnx_chunk.errors import ClosedError, InputError
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.model_folder import GenaiConfig, check_utf8_path, locate_model
from onnx_chunk.runtime.caches.graph_cache import plan_graphs
from onnx_chunk.runtime.caches.variant_cache import VariantCache
from onnx_chunk.runtime.caches.variant_pool import VariantPool
from onnx_chunk.runtime.device.memory import meter_for
from onnx_chunk.runtime.device.provider import Device, resolve_device
from onnx_chunk.runtime.device.session_factory import (
    QUANTIZED_MATMUL,
    SessionFactory,
    SharedWeights,
    load_shared_weights,
    owned_by_session,
)
from onnx_chunk.runtime.engine.batch_engine import (
    BatchEngine,
    EngineContext,
    runtime_engine,
)
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.plan import StepResult
from onnx_chunk.runtime.engine.request import CheckedRequest, Request
from onnx_chunk.runtime.engine.sequence import Sequence
from onnx_chunk.runtime.engine.sequence_pool import SequencePool, new_slot
from onnx_chunk.runtime.engine.speculation import Speculation
from onnx_chunk.runtime.loading import analyzed_plan, embedding_table, runnable_decoder
from onnx_chunk.runtime.options import (
    ResolvedOptions,
    RuntimeOptions,
    given_options,
    resolve_options,
)
from onnx_chunk.runtime.runner.attention_mask import AttentionMask, mask_kind
from onnx_chunk.runtime.runner.chunk_mask import chunk_mask_kind
from onnx_chunk.runtime.runner.model_runner import ModelRunner
from onnx_chunk.runtime.state.ports import ModelPorts
from onnx_chunk.runtime.stats import RuntimeStats, kv_dtype_name

if TYPE_CHECKING:
    from onnx_chunk.sampling import Sampling

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class RuntimeDebug:
    """A loaded runtime's parts, for tests and diagnostics (`Runtime.debug`): not a stable API.

    Code that uses a runtime reads `Runtime.stats` and calls its public methods; this view
    names what the runtime is made of, for a test or a diagnosis to look inside.
    """

    model_path: Path
    genai: GenaiConfig | None
    plan: ChunkPlan
    options: ResolvedOptions
    ports: ModelPorts
    device: Device
    weights: SharedWeights
    factory: SessionFactory
    variants: VariantPool
    cache: VariantCache[ort.InferenceSession]
    masks: type[AttentionMask]
    pool: SequencePool
    runner: ModelRunner
    embeddings: np.ndarray | None
    engine: BatchEngine | None


class Runtime:
    """One decoder loaded on one device for chunked prefill and generation of token ids (text
    goes through `onnx_chunk.text`: `generate_text(runtime, ...)`, which takes a runtime).

    `load(model_path, options)` is the same call. `options` is a `RuntimeOptions` (its docstring
    says what each field does), checked before the model is read (ConfigError); its fields may
    be given as keywords instead (`load(path, capacity=4096)`), which make the one
    `RuntimeOptions` here: an unknown keyword is a ConfigError naming it. What the runtime
    resolves from them (its capacity, ladder, padding, ...) is in `stats`.

    model_path: the decoder's .onnx file, or its folder (the decoder genai_config.json names,
        else model.onnx). A genai_config.json that applies to the decoder gives the defaults
        of the options; explicit ones override it.
    embeddings: the [vocab, hidden] table of an inputs_embeds decoder (default the
        embeddings.npy beside the model).
    graph: the decoder's graph, serialized, run in place of the file's (an edited copy, as
        ONNX Runtime takes model bytes): its external data, plan analysis, tokenizer and
        configs are still read from model_path and its folder, which is never written.

    `close()` (or leaving a `with` block) frees the sessions and buffers at once; a runtime is
    also freed as soon as its last reference (and every sequence's) goes.
    """

    def __init__(self, model_path: str | os.PathLike, options: RuntimeOptions | None = None,
                 *, embeddings: np.ndarray | None = None, graph: bytes | None = None,
                 **option_fields: Any) -> None:
        # Two ONNX Runtime wheels in one folder overwrite each other's module: say so first.
        check_one_wheel()
        args = given_options(options, option_fields)
        check_utf8_path(model_path)
        location = locate_model(model_path)
        self._model_path: Path = location.onnx_path
        self._genai: GenaiConfig | None = location.genai
        genai = self._genai or GenaiConfig(path=location.folder / "genai_config.json")
        chosen = (args.device if args.device is not None
                  else resolve_device(args.provider, args.device_id, args.mask_policy,
                                      args.cuda_graphs))
        model, plan, graph = runnable_decoder(self._model_path, graph, chosen, exact=args.exact)
        if args.chunk_size is None and (plan is None or plan.chunk_size is None):
            args = dataclasses.replace(args, chunk_size=genai.chunk_size)
        if plan is None:
            plan = analyzed_plan(self._model_path, args.chunk_size, model.data_files())
        self._plan: ChunkPlan = plan
        self._options: ResolvedOptions = resolve_options(
            args, plan=plan, genai=genai, model=model,
            device=chosen)
        resolved = self._options
        self._device: Device = resolved.device
        self._ports: ModelPorts = resolved.ports
        self._embeddings = embedding_table(self._ports, self._model_path, embeddings)
        # The names the wiring below reads.
        specialize = resolved.specialize
        variants = resolved.max_variants
        fixed_dims = resolved.fixed_dims
        idle_sequences = resolved.idle_sequences
        quantized = model.uses(QUANTIZED_MATMUL, "com.microsoft")
        meter = meter_for(self._device.device_type, self._device.device_id)
        # One session (the shape-generic mode) loads its own weights the plain way; several
        # variants share one copy loaded here (see session_factory).
        self._weights: SharedWeights = (owned_by_session(model) if specialize is False
                                        else load_shared_weights(model, self._device, meter))
        self._factory = SessionFactory(self._model_path, self._weights, self._device,
                                       query_dim=self._ports.query_dim, fixed_dims=fixed_dims,
                                       intra_op_threads=args.intra_op_threads, graph=graph)
        # The variant pool, the sequence pool and the forward runner (what a sequence runs
        # on) never refer back to the runtime: no reference cycle.
        self._variants = VariantPool(self._factory, specialize=specialize, quantized=quantized,
                                     cap=variants, meter=meter, select_rows=resolved.select_rows,
                                     padding=resolved.padding,
                                     padding_refused=resolved.padding_refused,
                                     graph_plan=plan_graphs(resolved.tiers, resolved.max_batch,
                                                            bool(self._ports.state)))
        self._cache: VariantCache[ort.InferenceSession] = self._variants.cache
        # The mask policy, chosen once: the class of every slot's and batch's mask (native
        # chunks: per-row counts of ones in a mask at least the padded width wide).
        self._masks: type[AttentionMask] = (
            mask_kind(self._device.mask_policy) if self._ports.query_seqlens is None
            else chunk_mask_kind(self._device.mask_policy))
        self._pool = SequencePool(
            functools.partial(new_slot, self._ports, resolved.capacity, self._device, self._masks),
            self._variants.release_slot, keep=idle_sequences, claim=self._variants.claim)
        self._runner = ModelRunner(self._variants, self._ports, self._device,
                                   capacity=resolved.capacity, tiers=resolved.tiers,
                                   specialize=specialize, embeddings=self._embeddings,
                                   exact=resolved.exact)
        self._speculation = (None if resolved.speculative is None
                             else Speculation.for_ports(self._ports, quantized))
        self._engine: BatchEngine | None = None
        self._engine_lock = threading.Lock()
        self._closed = False
        # The one shape-generic session (the CPU default) serves every forward: it is built
        # here, so that `load` returns a runtime ready to run (docs/runtime.md, "Cold start").
        if specialize is False:
            with self._cache.acquire(resolved.decode_key):
                pass
        logger.info("loaded %s on %s: capacity %d, chunk %d, ladder %s, padding %s",
                    self._model_path, self._device.label, resolved.capacity, resolved.chunk_size,
                    resolved.tiers, self._padding_mode if resolved.padding
                    else f"off ({resolved.padding_refused})")

    @property
    def _padding_mode(self) -> str:
        """How remainder chunks run: "native" (right-padded, GroupQueryAttention's
        query_seqlens), "repeat" (padded rows repeat the last token and are rewound) or
        "off" (each chunk at its own width)."""
        if not self._variants.padding:
            return "off"
        return "native" if self._runner.native else "repeat"

    def open_sequence(self) -> Sequence:
        """A new, empty sequence with its own KV buffers, sharing this model's sessions.

        Its buffers come from the pool of closed sequences' when one is idle (with the CUDA
        graphs captured on them); close it (or use it in a `with` block) to give them back.
        """
        if self._closed:
            raise ClosedError("this runtime was closed; load the model again to open sequences")
        return Sequence(self._runner, self._pool, chunk_size=self._options.chunk_size,
                        eos_token_ids=self._options.eos_token_ids,
                        speculation=self._speculation)

    def submit(self, prompt_ids: SequenceOf[int] | np.ndarray, max_new_tokens: int, *,
               eos_token_id: int | SequenceOf[int] | None = None,
               sampling: Sampling | None = None, wait: bool = False) -> Request:
        """Queue a generation for the batch engine and return its `Request` at once.

        Callable from any thread. Checked here (InputError, CapacityError) before it is
        queued; QueueFullError when `max_queue` requests already wait (`wait=True`: wait for
        room instead). `eos_token_id` None: the runtime's; `sampling` None: greedy. See
        docs/engine.md.
        """
        return self._engine_for().submit(
            self._checked(prompt_ids, max_new_tokens, eos_token_id, sampling), wait=wait)

    def submit_choices(self, prompt_ids: SequenceOf[int] | np.ndarray, max_new_tokens: int,
                       samplings: SequenceOf[Sampling], *,
                       eos_token_id: int | SequenceOf[int] | None = None,
                       wait: bool = False) -> list[Request]:
        """Several generations of one prompt (OpenAI's `n`), one per sampling, prefilled once:
        the others start from a device copy of the first's KV after its prefill (see
        docs/engine.md). Checked and queued as `submit`; a `Request` per sampling, in order."""
        if not samplings:
            raise InputError("submit_choices needs at least one sampling (one per choice)")
        if len(samplings) == 1:  # one choice is one request
            return [self.submit(prompt_ids, max_new_tokens, eos_token_id=eos_token_id,
                                sampling=samplings[0], wait=wait)]
        return self._engine_for().submit_choices(
            [self._checked(prompt_ids, max_new_tokens, eos_token_id, sampling)
             for sampling in samplings], wait=wait)

    def generate_many(self, prompts: Iterable[SequenceOf[int] | np.ndarray],
                      max_new_tokens: int, *, eos_token_id: int | SequenceOf[int] | None = None,
                      sampling: Sampling | None = None) -> list[list[int]]:
        """Every prompt through the batch engine, at most `max_batch` at once; the new tokens
        of each, in input order. Every prompt is checked before any runs."""
        checked = [self._checked(prompt, max_new_tokens, eos_token_id, sampling)
                   for prompt in prompts]
        requests: list[Request] = []
        try:
            for one in checked:
                requests.append(self._engine_for().submit(one, wait=True))
            return [request.result() for request in requests]
        finally:
            for request in requests:
                request.cancel()

    def step(self) -> StepResult:
        """Run one step of the batch engine in this thread (see docs/engine.md, "A step"):
        what `submit`'s background thread runs while there is work; a step lock runs it
        between the thread's. A `StepResult` (`ran` False: nothing was queued or running);
        ClosedError once the runtime was closed."""
        if self._closed:
            raise ClosedError("this runtime was closed; load the model again to run steps")
        with self._engine_lock:
            engine = self._engine
        # Nothing was ever submitted: no engine (nor its buffers) to make for an empty step.
        return StepResult() if engine is None else engine.step()

    def check_request(self, prompt_ids: SequenceOf[int] | np.ndarray,
                      max_new_tokens: int) -> np.ndarray:
        """A submission's ids, checked without queueing anything (InputError, CapacityError)."""
        return self._checked(prompt_ids, max_new_tokens, (), None).prompt

    def _checked(self, prompt_ids: object, max_new_tokens: object, eos_token_id: object,
                 sampling: Sampling | None) -> CheckedRequest:
        """A request checked before it is queued (`CheckedRequest.check`), on a fresh slot."""
        if self._closed:
            raise ClosedError("this runtime was closed; load the model again to submit")
        return CheckedRequest.check(prompt_ids, max_new_tokens, eos_token_id, sampling,
                                    vocab=self._ports.vocab_size,
                                    eos_default=self._options.eos_token_ids,
                                    room=LogicalLength(self._options.capacity))

    def _engine_for(self) -> BatchEngine:
        with self._engine_lock:
            if self._closed:
                raise ClosedError("this runtime was closed; load the model again to submit")
            if self._engine is None:
                self._engine = runtime_engine(self._engine_context(), self._options.max_batch,
                                              self._options.max_queue)
            return self._engine

    def _engine_context(self) -> EngineContext:
        """What the batch engine uses of this runtime (it never holds the runtime itself)."""
        options = self._options
        return EngineContext(runner=self._runner, ports=self._ports, device=self._device,
                             capacity=options.capacity, chunk_size=options.chunk_size,
                             masks=self._masks, take_number=self._pool.take_number,
                             give_number=self._pool.give_number,
                             release_graphs=self._variants.claim,
                             prefix_reuse=options.prefix_reuse,
                             speculation=self._speculation, exact=options.exact)

    def close(self) -> None:
        """Free the sessions, the pooled sequence buffers and their CUDA graphs now.

        Idempotent. The batch engine stops first (its queued and running requests fail with
        ClosedError). A forward running in another thread finishes first (its session is freed
        when it ends); every later forward of the runtime or its sequences, and every submit,
        is a ClosedError (reading stats or a sequence's state still works).
        """
        if self._closed:
            return
        self._closed = True
        # First, so that no sequence starts a forward while the engine stops.
        self._variants.close()
        with self._engine_lock:
            engine = self._engine
        if engine is not None:
            engine.close()
        self._pool.close()
        logger.info("closed the runtime of %s", self._model_path)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def model_path(self) -> Path:
        """The decoder file this runtime runs (its folder holds the tokenizer and configs)."""
        return self._model_path

    @property
    def genai(self) -> GenaiConfig | None:
        """The genai_config.json that applies to the decoder (None when there is none)."""
        return self._genai

    @property
    def debug(self) -> RuntimeDebug:
        """The runtime's parts, for tests and diagnostics (not a stable API; see RuntimeDebug)."""
        with self._engine_lock:
            engine = self._engine
        return RuntimeDebug(
            model_path=self._model_path, genai=self._genai, plan=self._plan, options=self._options,
            ports=self._ports, device=self._device, weights=self._weights, factory=self._factory,
            variants=self._variants, cache=self._cache, masks=self._masks, pool=self._pool,
            runner=self._runner, embeddings=self._embeddings, engine=engine)

    @property
    def stats(self) -> RuntimeStats:
        """The runtime's configuration and its variant cache's counters, now (a snapshot).

        A property; the old call `runtime.stats()` still works and warns (DeprecationWarning).
        """
        options = self._options
        graphs = self._variants.graphs.snapshot()
        return RuntimeStats(
            provider=self._device.provider,
            device=self._device.label,
            mask_policy=self._device.mask_policy.value,
            cuda_graphs=self._device.cuda_graphs,
            capacity=options.capacity,
            chunk_size=options.chunk_size,
            ladder=options.tiers,
            specialize=options.specialize,
            padding=self._padding_mode,
            weights_bytes=self._weights.nbytes,
            weights_shared=self._weights.shared and not self._weights.copied_per_session,
            weights_copied_per_variant=self._weights.copied_per_session,
            weights_resident_bytes=self._weights.resident_bytes,
            sessions_created=self._factory.sessions_created,
            cache=self._cache.snapshot(),
            sessions=self._factory.sessions_alive,
            weights_copies=self._factory.weights_copies,
            graphs=graphs,
            graph_widths=tuple(sorted(graphs.by_width)),
            graphs_captured=graphs.captures,
            graphs_by_width=dict(graphs.by_width),
            graphs_released=graphs.released + graphs.evictions,
            graph_fallbacks=dict(graphs.fallbacks),
            transfers=self._device.transfers.snapshot(),
            sequences=self._pool.stats(),
            max_batch=options.max_batch,
            prefix_reuse=options.prefix_reuse,
            engine=None if self._engine is None else self._engine.stats,
            speculative=options.speculative,
            exact=options.exact,
            kv_bytes=sum(int(np.prod(port.shape)) * port.dtype.itemsize
                         for port in self._ports.kv),
            kv_dtype=kv_dtype_name(port.dtype for port in self._ports.kv),
            model=str(self._model_path),
            vocab_size=self._ports.vocab_size,
            eos_token_ids=options.eos_token_ids,
        )


# The public entry point: `onnx_chunk.load(path, provider="auto", ...)` builds a Runtime.
load = Runtime
