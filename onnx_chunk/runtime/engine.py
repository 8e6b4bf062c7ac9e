"""A loaded decoder: its plan, device, shared weights and variant cache; sequences open on it.

`load(path)` reads the chunked-prefill plan from the model's metadata (or runs the passes in
memory on an unconverted model), picks the device, loads the weights once and sets up the
variant cache. `Runtime.open_sequence()` gives independent sequences that share all of it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_chunk import arguments
from onnx_chunk.errors import ConfigError, ModelLoadError, ProviderError
from onnx_chunk.metadata import ChunkPlan, read_plan
from onnx_chunk.runtime.cuda_graphs import GraphRuns, GraphSlots, capturable, session_captures
from onnx_chunk.model_io import check_utf8_path, load_model
from onnx_chunk.runtime.ladder import DECODE_WIDTH, ladder_tiers
from onnx_chunk.runtime.memory import meter_for
from onnx_chunk.runtime.padding import resolve_padding
from onnx_chunk.runtime.ports import ModelPorts, model_ports
from onnx_chunk.runtime.provider import Device, MaskPolicy, device_for, resolve_device
from onnx_chunk.runtime.sequence import Sequence
from onnx_chunk.runtime.session_factory import (QUANTIZED_MATMUL, SessionFactory,
                                                 SharedWeights, load_shared_weights,
                                                 owned_by_session)
from onnx_chunk.runtime.stats import RuntimeStats
from onnx_chunk.runtime.variant_cache import (EXACT, Specialize, VariantCache, VariantKey,
                                              variant_key)

logger = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.npy"


class Runtime:
    """One decoder loaded on one device for chunked prefill and greedy generation.

    `load(model_path, **options)` is the same call.

    provider: "auto" (CUDA when a CUDA session works here, else CPU), "cuda" or "cpu".
    capacity: the KV capacity (maximum sequence length); default the model's
        plan.max_sequence_length.
    chunk_size: the prefill chunk width W; default the model's
        runtime_configurable.chunked_prefill.chunk_size (an unconverted model gets what
        `onnx-chunk convert` would declare), else the capacity (no chunking).
    padding: None follows the environment (ONNX_CHUNK_PREFILL_QUERY_PADDING=0 switches it off,
        =1 on), else the mode's default: on with per-width variants, off with the one
        shape-generic session (a padded chunk there only computes more rows); True or False
        decide; the model's plan can always refuse it.
    specialize: None: the provider's default (Device.specialize: shape-generic on CPU,
        per-width on CUDA); True: one session per ladder width and one for decode, other widths
        share one shape-generic session, all sharing one copy of the weights; False: one
        shape-generic session for everything, which loads its own weights; "exact": a session
        per distinct width (the naive per-shape cache that thrashes, for comparison).
    max_variants: the variant cache cap (default the plan's); also sizes the ladder.
    mask_policy: "logical" or "capacity"; default chosen per provider.
    embeddings: the [vocab, hidden] table of an inputs_embeds decoder (default the
        embeddings.npy beside the model).
    cuda_graphs: capture a CUDA graph per fixed-width variant (default: on for CUDA with the
        capacity mask; see onnx_chunk.runtime.cuda_graphs).
    device: a resolved `Device` to run on, in place of provider, device_id, mask_policy and
        cuda_graphs (for example the CPU device marked not host-visible, which runs the
        device-memory path of CUDA on CPU).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        provider: str = "auto",
        device_id: int = 0,
        capacity: int | None = None,
        chunk_size: int | None = None,
        padding: bool | None = None,
        specialize: Specialize | None = None,
        max_variants: int | None = None,
        mask_policy: MaskPolicy | str | None = None,
        intra_op_threads: int | None = None,
        embeddings: np.ndarray | None = None,
        cuda_graphs: bool | None = None,
        device: Device | None = None,
    ) -> None:
        _check_options(capacity=capacity, chunk_size=chunk_size, max_variants=max_variants,
                       device_id=device_id, intra_op_threads=intra_op_threads,
                       padding=padding, cuda_graphs=cuda_graphs)
        check_utf8_path(model_path)
        self.model_path = Path(model_path)
        model = load_model(self.model_path)
        plan = read_plan(model)
        if plan is None:
            from onnx_chunk.passes import DEFAULT_CHUNK_SIZE, analyze

            logger.info("%s carries no chunked-prefill plan; running the passes in memory",
                        self.model_path)
            plan = analyze(model, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)
        self.plan: ChunkPlan = plan
        # The ids a generation stops at when its call names none.
        self.eos_token_ids: tuple[int, ...] = ()
        self.device: Device = (device if device is not None
                               else resolve_device(provider, device_id, mask_policy, cuda_graphs))
        self.capacity = _resolve_capacity(capacity, plan)
        self.ports: ModelPorts = model_ports(model, plan, self.capacity)
        if device is None:
            self.device = _attention_device(self.device, self.ports, provider, mask_policy)
        else:
            _attention_device(self.device, self.ports, self.device.provider, mask_policy)
        self.chunk_size = _resolve_chunk_size(chunk_size, plan, self.capacity)
        variants = plan.max_variants if max_variants is None else max_variants
        self.tiers: tuple[int, ...] = (plan.ladder if plan.ladder and plan.chunk_size ==
                                       self.chunk_size and max_variants is None
                                       else ladder_tiers(self.chunk_size, variants))
        if specialize is None:
            specialize = self.device.specialize
        if specialize not in (True, False, EXACT):
            raise ConfigError(f"specialize must be True, False or {EXACT!r}, got {specialize!r}")
        self.specialize: Specialize = specialize
        self.decode_key: VariantKey = variant_key(DECODE_WIDTH, self.tiers, specialize)
        self.embeddings = self._embeddings(embeddings)
        # Padding pays only where a padded chunk reuses a variant built for its width.
        self._padding, refused = resolve_padding(plan.padding, padding,
                                                 default=specialize is not False)
        self._padding_lock = threading.Lock()
        fixed_dims = dict(self.ports.fixed_dims)
        if self.device.mask_policy is MaskPolicy.CAPACITY and self.ports.mask_dim is not None:
            fixed_dims[self.ports.mask_dim] = self.capacity
        self._quantized = any(node.op_type == QUANTIZED_MATMUL for node in model.graph.all_nodes())
        meter = meter_for(self.device.device_type, self.device.device_id)
        # One session (the shape-generic mode) loads its own weights the plain way; several
        # variants share one copy loaded here (see session_factory).
        self.weights: SharedWeights = (owned_by_session(model) if specialize is False
                                       else load_shared_weights(model, self.device, meter))
        self.factory = SessionFactory(self.model_path, self.weights, self.device,
                                      query_dim=self.ports.query_dim, fixed_dims=fixed_dims,
                                      intra_op_threads=intra_op_threads)
        # Each session's IOBindings, per sequence; dropped when the cache releases the session,
        # so no sequence keeps an evicted session (and the memory it holds) alive.
        self._bindings: dict[ort.InferenceSession, weakref.WeakKeyDictionary] = {}
        self._bindings_lock = threading.Lock()
        # Graph slots of the live sessions that capture CUDA graphs, dropped with the session.
        self._graph_slots: dict[ort.InferenceSession, GraphSlots] = {}
        self._graph_widths: set[int] = set()
        self.cache: VariantCache[ort.InferenceSession] = VariantCache(
            self._build_variant, self._release_variant, cap=variants, meter=meter)
        self.cache.note_padding_refused(refused)
        logger.info("loaded %s on %s: capacity %d, chunk %d, ladder %s, padding %s",
                    self.model_path, self.device.label, self.capacity, self.chunk_size,
                    self.tiers, "on" if self._padding else f"off ({refused})")

    @property
    def provider(self) -> str:
        """The provider the runtime runs on: "cpu" or "cuda"."""
        return self.device.provider

    @property
    def padding(self) -> bool:
        """Whether prefill chunks are padded up the ladder."""
        return self._padding

    def open_sequence(self) -> Sequence:
        """A new, empty sequence with its own KV buffers, sharing this model's sessions."""
        return Sequence(self)

    def stats(self) -> RuntimeStats:
        """The runtime's configuration and its variant cache's counters, now."""
        return RuntimeStats(
            provider=self.provider,
            device=self.device.label,
            mask_policy=self.device.mask_policy.value,
            cuda_graphs=self.device.cuda_graphs,
            capacity=self.capacity,
            chunk_size=self.chunk_size,
            ladder=self.tiers,
            specialize=self.specialize,
            padding=self._padding,
            weights_bytes=self.weights.nbytes,
            weights_shared=self.weights.shared,
            weights_resident_bytes=self.weights.resident_bytes,
            sessions_created=self.factory.sessions_created,
            cache=self.cache.snapshot(),
            graph_widths=tuple(sorted(self._graph_widths)),
        )

    def disable_padding(self, reason: str) -> None:
        """Switch padding off for good (the run-time self-check found it unsafe)."""
        with self._padding_lock:
            if self._padding:
                logger.warning("padding switched off: %s", reason)
                self._padding = False
                self.cache.note_padding_refused(reason)

    def bindings(self, session: ort.InferenceSession, sequence: Sequence) -> OrderedDict:
        """The IOBindings `sequence` keeps on a live `session`, by width (the caller fills it)."""
        with self._bindings_lock:
            per_sequence = self._bindings.setdefault(session, weakref.WeakKeyDictionary())
            return per_sequence.setdefault(sequence, OrderedDict())

    def graph_runs(self, session: ort.InferenceSession, stateful: bool) -> GraphRuns | None:
        """The CUDA graph run options of a new binding on `session` (None: it captures none)."""
        with self._bindings_lock:
            slots = self._graph_slots.get(session)
        return None if slots is None else slots.runs(stateful)

    def _release_variant(self, session: ort.InferenceSession) -> None:
        with self._bindings_lock:
            self._bindings.pop(session, None)
            self._graph_slots.pop(session, None)

    def _build_variant(self, key: VariantKey) -> ort.InferenceSession:
        # Pre-pack where it pays (see session_factory): the decode shape, a lone session that
        # also decodes, and every session of a model with quantized MatMulNBits weights.
        prepack = key == DECODE_WIDTH or not self.specialize or self._quantized
        session = self.factory.create(key, prepack=prepack,
                                      capture=capturable(self.device, key))
        if key is not None and session_captures(session):
            with self._bindings_lock:
                self._graph_slots[session] = GraphSlots()
                self._graph_widths.add(key)
        return session

    def _embeddings(self, given: np.ndarray | None) -> np.ndarray | None:
        if self.ports.token_input != "inputs_embeds":
            return None
        if given is None:
            path = self.model_path.parent / EMBEDDINGS_FILE
            if not path.is_file():
                raise ModelLoadError(
                    f"the decoder takes inputs_embeds, so the runtime needs the embedding table: "
                    f"expected {str(path)!r} ([vocab, hidden] .npy) or the embeddings argument")
            given = np.load(path, mmap_mode="r")
        hidden = self.ports.hidden_size
        if given.ndim != 2 or given.shape[1] != hidden:
            raise ModelLoadError(f"the embedding table must be [vocab, {hidden}], got "
                                 f"{list(given.shape)}")
        return given



# The public entry point: `onnx_chunk.load(path, provider="auto", ...)` builds a Runtime.
load = Runtime


# The dtypes ONNX Runtime's CUDA GroupQueryAttention kernel is registered for.
_CUDA_ATTENTION_DTYPES = ("float16", "bfloat16")


def _attention_device(device: Device, ports: ModelPorts, provider: str,
                      mask_policy: MaskPolicy | str | None) -> Device:
    """`device`, unless CUDA cannot run this decoder's attention.

    ONNX Runtime's CUDA GroupQueryAttention runs float16 and bfloat16 only; a float32 decoder's
    attention would fall back to the CPU provider, copying the whole KV cache both ways every
    step (and no CUDA graph can be captured). "auto" then runs on CPU and says why; "cuda"
    refuses.
    """
    if device.provider != "cuda" or not ports.kv:
        return device
    dtype = ports.kv[0].dtype.name
    if dtype in _CUDA_ATTENTION_DTYPES:
        return device
    reason = (f"ONNX Runtime's CUDA GroupQueryAttention runs {' and '.join(_CUDA_ATTENTION_DTYPES)}"
              f" only, and this decoder's KV cache is {dtype}: its attention would run on the "
              "CPU with the cache copied every step")
    if provider == "auto":
        logger.warning("%s; running on CPU instead (export the decoder in float16 for CUDA)",
                       reason)
        return device_for("cpu", mask_policy=mask_policy)
    raise ProviderError(f"{reason}; export it in float16 (onnx-chunk build-model --dtype "
                        "float16 for the reference decoders) or use --provider cpu")


def _check_options(*, capacity: object, chunk_size: object, max_variants: object,
                   device_id: object, intra_op_threads: object, padding: object,
                   cuda_graphs: object) -> None:
    """ConfigError for an option of the wrong type or range, before anything is loaded."""
    arguments.optional_integer(capacity, "the capacity (capacity)", minimum=2, error=ConfigError)
    arguments.optional_integer(chunk_size, "the chunk size (chunk_size)", minimum=1, error=ConfigError)
    arguments.optional_integer(max_variants, "max_variants", minimum=1, error=ConfigError)
    arguments.integer(device_id, "device_id", minimum=0, error=ConfigError)
    arguments.optional_integer(intra_op_threads, "intra_op_threads", minimum=0,
                               error=ConfigError)
    for name, value in (("padding", padding), ("cuda_graphs", cuda_graphs)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} must be True, False or None, got {value!r}")


def _resolve_capacity(capacity: int | None, plan: ChunkPlan) -> int:
    limit = plan.max_sequence_length
    if capacity is None:
        if limit is None:
            raise ConfigError("the model declares no maximum sequence length; pass a capacity "
                              "(--capacity) to size the KV buffers")
        return int(limit)
    if capacity < 2:
        raise ConfigError(f"the capacity must be at least 2 positions, got {capacity}")
    if limit is not None and capacity > limit:
        raise ConfigError(f"capacity {capacity} exceeds the model's maximum sequence length "
                          f"{limit} (its position tables end there); use at most {limit}")
    return capacity


def _resolve_chunk_size(chunk_size: int | None, plan: ChunkPlan, capacity: int) -> int:
    width = chunk_size if chunk_size is not None else plan.chunk_size
    if width is None:
        return capacity
    if width < 1:
        raise ConfigError(f"the chunk size must be at least 1, got {width}")
    return min(width, capacity)
