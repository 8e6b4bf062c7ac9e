"""A runtime's options: what the user asks for (`RuntimeOptions`) and what the runtime
resolves from it once (`ResolvedOptions`), before anything is loaded on the device.

`RuntimeOptions` is the public, typed form of `load`'s keyword arguments: it refuses an option
of the wrong type or range (ConfigError) when it is made, before the model is read.
`resolve_options` combines it with the plan, genai_config.json, the decoder's ports and the
device into a `ResolvedOptions`, which `Runtime` only reads and which is internal (code outside
the runtime reads `Runtime.stats`). Both are pure: no ONNX Runtime call (the device is resolved
by the caller).

Rules of `resolve_options`:
1. Capacity: the option, else genai's search.max_length, else the smallest of the plan's
   maximum sequence length and genai's model.context_length; never more than either limit,
   never below the widest sliding window (a window-sized cache cannot be shorter).
2. Chunk size: the option, else the plan's, else the capacity (no chunking); at most the
   capacity.
3. Ports are resolved for that capacity; a window-sized cache gets a chunk of slack where the
   device allows it.
4. A decoder CUDA cannot run (a float32 KV cache, which CUDA's GroupQueryAttention does not
   take; `convert --int8-matmul`'s matmuls, which ONNX Runtime runs on the CPU provider
   only): "auto" falls back to CPU, "cuda" (or a given CUDA device) refuses.
5. Ladder: the plan's when its chunk size is kept and no max_variants is given, else one built
   for the chunk size and the variant cap (the plan's, or the option).
6. Specialisation: the option, else the device's default; padding: the option, the
   environment or the mode's default (on with per-width sessions or CUDA graphs, whose ladder
   tiers capture; off on the one CPU session), and the plan may refuse it.
7. Fixed dims: the ports', less the batch axis above one slot, plus a capacity-wide mask under
   the capacity mask policy.
8. Speculative decoding ("prompt-lookup") is refused for a decoder that cannot take a
   rejected draft back (recurrent state) or verify it per row (last-row logits only).
9. Exact mode (`exact`, docs/row_grouping.md) rounds odd ladder tiers up to even widths
   and refuses speculative decoding (a verification
   computes in one forward rows that plain decoding computes one at a time, and ONNX
   Runtime's kernels round the two differently) and a decoder that returns the last row's
   logits only (an odd prompt forward gets a padded row, which would be that row).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from onnx_chunk import arguments
from onnx_chunk.errors import ConfigError, ModelLoadError, ProviderError
from onnx_chunk.graph.chunk_plan import ChunkPlan, check_window_capacity
from onnx_chunk.graph.metadata import INT8_MATMUL_KEY, read_int8_matmul
from onnx_chunk.graph.model_file import ModelFile
from onnx_chunk.graph.model_folder import GenaiConfig
from onnx_chunk.ladder import DECODE_WIDTH, ladder_tiers
from onnx_chunk.runtime.caches.cuda_graphs import capturable
from onnx_chunk.runtime.caches.variant_cache import EXACT, Specialize, VariantKey, variant_key
from onnx_chunk.runtime.device.provider import Device, MaskPolicy, device_for
from onnx_chunk.runtime.engine.batch_engine import DEFAULT_MAX_QUEUE
from onnx_chunk.runtime.engine.sequence_pool import DEFAULT_IDLE_SLOTS
from onnx_chunk.runtime.engine.speculation import SPECULATIVE_CHOICES, speculation_refused
from onnx_chunk.runtime.runner.padding import resolve_padding
from onnx_chunk.runtime.state.ports import ModelPorts, model_ports

logger = logging.getLogger(__name__)

# The dtypes ONNX Runtime's CUDA GroupQueryAttention kernel is registered for.
CUDA_ATTENTION_DTYPES = ("float16", "bfloat16")
# The fused matmuls `convert --int8-matmul` wrote before (MatMulIntegerToFloat, and the
# DynamicQuantizeMatMul before it), kernels of ONNX Runtime's CPU provider only.
CPU_ONLY_MATMULS = ("MatMulIntegerToFloat", "DynamicQuantizeMatMul")


@dataclass(frozen=True)
class RuntimeOptions:
    """The options a user gives `load` (None: the default), checked when made: ConfigError for
    an option of the wrong type or range. Counts given as numpy integers are kept as ints.

    provider: "auto" (CUDA when a CUDA session works here, else CPU), "cuda" or "cpu".
    capacity: the KV capacity (maximum sequence length); default genai_config.json's
        search.max_length, else the model's plan.max_sequence_length; never more than either
        the plan's maximum or genai's model.context_length.
    chunk_size: the prefill chunk width W; default the model's
        runtime_configurable.chunked_prefill.chunk_size, else genai's search.chunk_size (an
        unconverted model gets what `onnx-chunk convert` would declare), else the capacity (no
        chunking).
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
    cuda_graphs: capture a CUDA graph per fixed-width variant (default: on for CUDA with the
        capacity mask; see onnx_chunk.runtime.caches.cuda_graphs).
    device: a resolved `Device` to run on, in place of provider, device_id, mask_policy and
        cuda_graphs (for example the CPU device marked not host-visible, which runs the
        device-memory path of CUDA on CPU).
    idle_sequences: how many closed sequences' buffers (and the CUDA graphs captured on them)
        are kept for the next sequences to reuse (see sequence_pool).
    max_batch: the slots of the batch engine behind `submit` and `generate_many`: how many
        sequences it serves at once (default 1). Above 1 every session leaves the batch axis
        free (prefill chunks run at batch 1, decode at `max_batch` rows); the batched decode
        captures a CUDA graph like any other binding (see docs/engine.md).
    max_queue: how many submitted requests may wait for a slot (QueueFullError beyond).
    prefix_reuse: whether an engine slot keeps its KV after its request ends, for a later
        request whose prompt starts with the same ids to reuse (default True; see
        docs/engine.md, "Prefix reuse").
    speculative: "prompt-lookup" drafts tokens from the prompt and the text so far and
        verifies them in one forward (greedy output identical to plain decoding, sampled
        output exact in distribution; see docs/speculative.md); None (default) decodes one
        token per forward. A decoder with recurrent state or last-row logits is refused.
    exact: a request's numbers do not depend on how its rows were grouped, bit for bit:
        chunked as one whole forward, batched as alone, a reused prefix as a fresh prefill
        (docs/row_grouping.md). Every prompt forward of several rows runs at an even width, a
        slot keeps only its prompt's rows for reuse, natively converted folders run the
        "repeat" path; speculative decoding and last-row-logits decoders are refused.
    device_id: the CUDA device's ordinal (provider "cuda" or "auto").
    intra_op_threads: ONNX Runtime's intra-op threads of every session (None: its default).
    """

    provider: str = "auto"
    device_id: int = 0
    capacity: int | None = None
    chunk_size: int | None = None
    padding: bool | None = None
    specialize: Specialize | None = None
    max_variants: int | None = None
    mask_policy: MaskPolicy | str | None = None
    intra_op_threads: int | None = None
    cuda_graphs: bool | None = None
    device: Device | None = None
    idle_sequences: int = DEFAULT_IDLE_SLOTS
    max_batch: int = 1
    max_queue: int = DEFAULT_MAX_QUEUE
    prefix_reuse: bool = True
    speculative: str | None = None
    exact: bool = False

    def __post_init__(self) -> None:
        arguments.optional_integer(self.capacity, "the capacity (capacity)", minimum=2,
                                   error=ConfigError)
        arguments.optional_integer(self.chunk_size, "the chunk size (chunk_size)", minimum=1,
                                   error=ConfigError)
        arguments.optional_integer(self.max_variants, "max_variants", minimum=1,
                                   error=ConfigError)
        arguments.integer(self.device_id, "device_id", minimum=0, error=ConfigError)
        arguments.optional_integer(self.intra_op_threads, "intra_op_threads", minimum=0,
                                   error=ConfigError)
        for name, value in (("padding", self.padding), ("cuda_graphs", self.cuda_graphs)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True, False or None, got {value!r}")
        for name, flag in (("prefix_reuse", self.prefix_reuse), ("exact", self.exact)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if self.exact and self.speculative is not None:
            raise ConfigError(
                f"speculative={self.speculative!r} cannot run in exact mode: a verification "
                "computes in one forward rows that plain decoding computes one at a time, and "
                "ONNX Runtime's kernels round the two differently; load without one of them")
        if self.speculative is not None and self.speculative not in SPECULATIVE_CHOICES:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE_CHOICES)} or "
                              f"None (plain decoding), got {self.speculative!r}")
        # Frozen: the checked counts are written past the dataclass's __setattr__.
        for name, minimum in (("idle_sequences", 0), ("max_batch", 1), ("max_queue", 1)):
            object.__setattr__(self, name, arguments.integer(
                getattr(self, name), name, minimum=minimum, error=ConfigError))


def given_options(options: RuntimeOptions | None, fields: dict[str, object]) -> RuntimeOptions:
    """`load`'s options: `options`, or the `RuntimeOptions` its keyword fields make (not both);
    ConfigError naming a keyword that is no option."""
    if options is not None and not isinstance(options, RuntimeOptions):
        raise ConfigError(f"options must be a RuntimeOptions, got {type(options).__name__}")
    if options is not None and fields:
        raise ConfigError(f"give the options as a RuntimeOptions or as keywords, not both "
                          f"(got options and {', '.join(sorted(fields))})")
    if options is not None:
        return options
    names = {field.name for field in dataclasses.fields(RuntimeOptions)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ConfigError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                          f"load takes {', '.join(sorted(names))}, embeddings and graph")
    return RuntimeOptions(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ResolvedOptions:
    """Everything a runtime runs with, resolved once from its `RuntimeOptions` (the rules of
    the module docstring). Internal: `Runtime.stats` reports what users may read of it, and
    `Runtime.debug.options` shows it whole to tests and diagnosis."""

    device: Device
    capacity: int
    chunk_size: int
    ports: ModelPorts
    tiers: tuple[int, ...]
    max_variants: int
    specialize: Specialize
    decode_key: VariantKey
    padding: bool
    padding_refused: str | None
    fixed_dims: dict[str, int]
    select_rows: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_batch: int
    max_queue: int
    idle_sequences: int
    intra_op_threads: int | None
    prefix_reuse: bool = True
    speculative: str | None = None
    exact: bool = False


def resolve_options(options: RuntimeOptions, *, plan: ChunkPlan, genai: GenaiConfig,
                    model: ModelFile, device: Device) -> ResolvedOptions:
    """What a runtime of `model` runs with on `device` (the given one, or the one resolved
    from the options); ConfigError, ProviderError or ModelLoadError when it cannot be."""
    capacity = resolve_capacity(options.capacity, plan, genai)
    check_window_capacity(plan.capacity_inputs, capacity)
    chunk_size = resolve_chunk_size(options.chunk_size, plan, capacity)
    ports = model_ports(model, plan, capacity, head_size=genai.head_size,
                        window_slack=chunk_size if device.window_slack else 0)
    if options.max_batch > 1 and ports.batch_dim is None:
        raise ConfigError(
            f"max_batch={options.max_batch} needs a decoder whose batch axis is free, and "
            f"{model.path.name} fixes it to 1 (its {ports.token_input!r} input); "
            "load it with max_batch=1 or export it with a symbolic batch size")
    eos_token_ids = checked_token_ids(genai.eos_token_ids, ports.vocab_size, genai.path)
    refused = None if options.speculative is None else speculation_refused(ports)
    if refused is not None:
        raise ConfigError(f"speculative={options.speculative!r} cannot run on {model.path.name}: "
                          f"{refused}; load it without speculative decoding")
    if options.exact and ports.last_row_logits:
        raise ConfigError(
            f"exact mode cannot run {model.path.name}: it returns the last row's logits only, "
            "and exact mode gives an odd prompt forward a padded row, which would be that row; "
            "convert it with logits rows (onnx-chunk convert, the default) or load it without "
            "exact")
    warn_unbounded_int8(model)
    if options.device is None:
        device = runnable_device(device, ports, model, options.provider, options.mask_policy)
    else:
        runnable_device(device, ports, model, device.provider, options.mask_policy)
    variants = plan.max_variants if options.max_variants is None else options.max_variants
    tiers = resolve_tiers(plan, chunk_size, options.max_variants)
    if options.exact:
        # Exact mode runs prompt forwards at even widths: even tiers stay the widths that run
        # (and capture), instead of one row past each odd one.
        tiers = tuple(sorted({tier + tier % 2 for tier in tiers}))
    specialize = device.specialize if options.specialize is None else options.specialize
    if specialize not in (True, False, EXACT):
        raise ConfigError(f"specialize must be True, False or {EXACT!r}, got {specialize!r}")
    # Padding pays only where a padded chunk reuses a variant built for its width, or a CUDA
    # graph captured at it (the ladder tiers capture on the one CUDA session).
    graphs = capturable(device)
    padding, refused = resolve_padding(plan.padding, options.padding,
                                       default=specialize is not False or graphs)
    return ResolvedOptions(
        device=device,
        capacity=capacity,
        chunk_size=chunk_size,
        ports=ports,
        tiers=tiers,
        max_variants=variants,
        specialize=specialize,
        decode_key=variant_key(DECODE_WIDTH, tiers, specialize),
        padding=padding,
        padding_refused=refused,
        fixed_dims=fixed_dims(ports, device, capacity, options.max_batch),
        # Off the host, a prefill width of a specialised session, or of a session that captures
        # graphs, returns only the logits row a forward needs (logits_row), so no sequence
        # keeps a [1, W, vocab] buffer per width; a decoder with a logits_rows input computes
        # only the rows it is fed, so it needs no such session.
        select_rows=(not device.host_visible and (specialize is not False or graphs)
                     and not ports.last_row_logits and ports.logits_rows is None),
        eos_token_ids=eos_token_ids,
        pad_token_id=genai.pad_token_id,
        max_batch=options.max_batch,
        max_queue=options.max_queue,
        idle_sequences=options.idle_sequences,
        intra_op_threads=options.intra_op_threads,
        prefix_reuse=options.prefix_reuse,
        speculative=options.speculative,
        exact=options.exact,
    )


def resolve_tiers(plan: ChunkPlan, chunk_size: int,
                  max_variants: int | None = None) -> tuple[int, ...]:
    """The ladder tiers a runtime of chunk width `chunk_size` pads to (rule 5)."""
    if plan.ladder and plan.chunk_size == chunk_size and max_variants is None:
        return plan.ladder
    return ladder_tiers(chunk_size, plan.max_variants if max_variants is None else max_variants)


def fixed_dims(ports: ModelPorts, device: Device, capacity: int,
               max_batch: int) -> dict[str, int]:
    """The free dimensions every session overrides (rule 7)."""
    dims = dict(ports.fixed_dims)
    if max_batch > 1 and ports.batch_dim is not None:
        # Decode runs max_batch rows, prefill one: the batch axis stays free.
        dims.pop(ports.batch_dim, None)
    if device.mask_policy is MaskPolicy.CAPACITY and ports.mask_dim is not None:
        dims[ports.mask_dim] = capacity
    return dims


def runnable_device(device: Device, ports: ModelPorts, model: ModelFile, provider: str,
                    mask_policy: MaskPolicy | str | None) -> Device:
    """`device`, unless CUDA cannot run this decoder (rule 4): "auto" then runs on CPU and says
    why; "cuda" refuses."""
    if device.provider != "cuda":
        return device
    refusal = cuda_refusal(ports, model)
    if refusal is None:
        return device
    reason, remedy = refusal
    if provider == "auto":
        logger.warning("%s; running on CPU instead (%s)", reason, remedy)
        return device_for("cpu", mask_policy=mask_policy)
    raise ProviderError(f"{reason}; {remedy}, or use --provider cpu")


def warn_unbounded_int8(model: ModelFile) -> None:
    """A warning for a folder `convert --int8-matmul` wrote before its weights were bounded to
    +-64: on a CPU without VNNI (AVX2, AVX-512 BW alone) ONNX Runtime's int8 kernel clips
    products of its +-127 weights (onnx_chunk.passes.int8_matmul.WEIGHT_MAX)."""
    declaration = read_int8_matmul(model.metadata)
    if declaration is not None and declaration.weight_max is None:
        logger.warning("%s was converted with an older --int8-matmul: its int8 weights span "
                       "+-127, which CPUs without VNNI multiply wrongly (ONNX Runtime's kernel "
                       "there clips pairs of products to int16); convert the original export "
                       "again with --int8-matmul", model.path)


def cuda_refusal(ports: ModelPorts, model: ModelFile) -> tuple[str, str] | None:
    """Why CUDA cannot run this decoder and what to do, or None.

    `convert --int8-matmul`'s matmuls would run on the CPU with their inputs copied both ways
    every forward: its MatMulInteger takes uint8 activations, and ONNX Runtime's CUDA
    MatMulInteger is registered for int8 by int8 only (core/providers/cuda/math/
    matmul_integer.cc); the MatMulIntegerToFloat and DynamicQuantizeMatMul it wrote before are
    registered for the CPU provider and no CUDA one (contrib_ops/cpu/cpu_contrib_kernels.cc).
    ONNX Runtime's CUDA GroupQueryAttention runs float16 and bfloat16 only: a float32 decoder's
    attention would fall back to the CPU provider, copying the whole KV cache both ways every
    step (and no CUDA graph can be captured).
    """
    for matmul in CPU_ONLY_MATMULS:
        if model.uses(matmul, "com.microsoft"):
            return (f"the model's matmuls are {matmul} (convert --int8-matmul), a kernel of "
                    "ONNX Runtime's CPU provider only",
                    "convert the export again with --no-int8-matmul for CUDA")
    if INT8_MATMUL_KEY in model.metadata and model.uses("MatMulInteger"):
        return ("the model's matmuls are MatMulInteger of uint8 activations (convert "
                "--int8-matmul), which ONNX Runtime runs on the CPU provider only",
                "convert the export again with --no-int8-matmul for CUDA")
    if not ports.kv or ports.kv[0].dtype.name in CUDA_ATTENTION_DTYPES:
        return None
    dtype = ports.kv[0].dtype.name
    return (f"ONNX Runtime's CUDA GroupQueryAttention runs {' and '.join(CUDA_ATTENTION_DTYPES)}"
            f" only, and this decoder's KV cache is {dtype}: its attention would run on the "
            "CPU with the cache copied every step",
            "export it in float16 (onnx-chunk build-model --dtype float16 for the reference "
            "decoders)")


def resolve_capacity(capacity: int | None, plan: ChunkPlan, genai: GenaiConfig) -> int:
    """The KV capacity (rule 1)."""
    limits = [(limit, why) for limit, why in (
        (plan.max_sequence_length, "the model's maximum sequence length {} (its position "
                                   "tables end there)"),
        (genai.context_length, f"the model.context_length {{}} of {genai.path.name}"),
    ) if limit is not None]
    if capacity is None:
        capacity = genai.max_length
        if capacity is None:
            if not limits:
                raise ConfigError("the model declares no maximum sequence length; pass a "
                                  "capacity (--capacity) to size the KV buffers")
            return min(limit for limit, _ in limits)
        capacity = min([capacity, *(limit for limit, _ in limits)])
        if capacity < 2:
            raise ConfigError(f"{genai.path.name}'s search.max_length gives a capacity of "
                              f"{capacity}; the KV cache needs at least 2 positions: pass a "
                              "capacity (--capacity)")
        return capacity
    if capacity < 2:
        raise ConfigError(f"the capacity must be at least 2 positions, got {capacity}")
    for limit, why in limits:
        if capacity > limit:
            raise ConfigError(f"capacity {capacity} exceeds {why.format(limit)}; use at most "
                              f"{limit}")
    return capacity


def resolve_chunk_size(chunk_size: int | None, plan: ChunkPlan, capacity: int) -> int:
    """The prefill chunk width (rule 2)."""
    width = chunk_size if chunk_size is not None else plan.chunk_size
    if width is None:
        return capacity
    if width < 1:
        raise ConfigError(f"the chunk size must be at least 1, got {width}")
    return min(width, capacity)


def checked_token_ids(ids: tuple[int, ...], vocab_size: int, source: Path) -> tuple[int, ...]:
    """`ids` (genai_config.json's EOS ids), each inside the vocabulary, else ModelLoadError."""
    outside = [token for token in ids if token >= vocab_size]
    if outside:
        raise ModelLoadError(f"{str(source)!r} names EOS token id(s) {outside} outside the "
                             f"model's vocabulary of {vocab_size}; fix the config")
    return ids
