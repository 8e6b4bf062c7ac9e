"""Execution provider selection: the one place that maps a provider name to a device.

A `Device` carries everything that differs between providers: the ONNX Runtime provider list
for sessions, where OrtValues are allocated (device type and id), whether that memory is
readable from the host without a copy, and the attention-mask width policy. The rest of the
runtime takes a `Device` and never asks which provider it is.

Mask policy, by measurement (CPU provider, GQA decoder):
1. `logical`: the mask is `past + rows` wide. On CPU this is what runs fastest: a 171-row chunk
   at past 100 took 22 ms against 34 ms with a 4096-wide mask, one decode row 0.37 ms against
   0.50 ms, because the CPU kernel's work follows the mask width.
2. `capacity`: the mask is as wide as the KV capacity (ones for the valid prefix, zeros in the
   tail). Byte-identical results, and every input but the query rows has a fixed shape, which is
   what CUDA graphs and static-shape providers need; chosen for CUDA.

CUDA provider options (ONNX Runtime's CUDAExecutionProvider; `Device.providers` gives every
session of a runtime the same ones, plus `enable_cuda_graph=1` for the variants that capture,
see `cuda_graphs`):
1. `device_id`: the GPU (the device's `session_providers`).
2. `arena_extend_strategy=kSameAsRequested`: the memory arena grows by what is asked, not by
   doubling, so the device memory a variant holds is what it needs, and the variant cache's
   readings (cudaMemGetInfo before and after a build) say so.
The CPU provider comes second in the list, for the shape-only nodes ONNX Runtime places there.

Specialisation, the per-provider default of `Runtime(specialize=None)` (docs/runtime.md has
the table; bench decoder, ~100M parameters fp32, CPU provider, 2 cores):
1. CPU: one shape-generic session (`specialize=False`). The CPU provider runs any shape in one
   session, so per-width sessions buy no compile, only a 3-8% faster forward, and each costs
   a session build and (the decode session) a pre-packed copy of the weights. Bench decoder:
   per-width variants 993 MiB resident, TTFT 288 ms for 40 tokens, 85-92 decode tokens/s;
   one session that owns its weights 588 MiB, 64 ms, 76-83 tokens/s.
2. CUDA: one session as well (`specialize=False`), holding one copy of the weights on the
   device; the fixed shapes CUDA graphs need are graphs captured on it per width and batch
   (`caches/graph_cache`), not sessions. Per-width CUDA sessions (`specialize=True`) each copy
   the weights to the device.

The CUDA probe of `provider="auto"` asks ONNX Runtime for a CUDA session; on a machine without
the CUDA libraries ORT's C++ loader prints its dlopen failures straight to file descriptor 2.
The probe runs once per process with descriptor 2 pointed at /dev/null, and the reason CUDA is
unusable goes to the log at INFO instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import onnxruntime as ort

from onnx_chunk.errors import ConfigError, ProviderError
from onnx_chunk.runtime.device.run_lock import options_for, run_lock
from onnx_chunk.runtime.device.transfers import Transfers

logger = logging.getLogger(__name__)

PROVIDER_CHOICES = ("auto", "cuda", "cpu")
T = TypeVar("T")

_CUDA_EP = "CUDAExecutionProvider"
_CPU_EP = "CPUExecutionProvider"
_ENABLE_CUDA_GRAPH = "enable_cuda_graph"
_CUDA_SESSION_OPTIONS = {"arena_extend_strategy": "kSameAsRequested"}
_ORT_DEFAULT_SEVERITY = 2  # warnings and above, ONNX Runtime's own default
# The probe's model, serialized: a float [1] Identity (IR 8, opset 17), as onnx.helper writes
# it (tests/runtime/test_provider.py rebuilds it), so that loading a model imports no onnx.
PROBE_MODEL = bytes.fromhex(
    "08083a3b0a100a017812017922084964656e74697479120570726f62655a0f0a0178120a0a08080112040a02"
    "0801620f0a0179120a0a08080112040a02080142040a001011")


class MaskPolicy(str, enum.Enum):
    """How wide the attention mask is bound (see the module docstring for the measurement)."""

    LOGICAL = "logical"
    CAPACITY = "capacity"


@dataclass(frozen=True)
class Device:
    """Where a runtime runs: the provider, the OrtValue device and the mask policy.

    `specialize` is the provider's default for per-width variants (see the module docstring).
    `window_slack` says whether a window-sized KV cache may hold more than its window: the CPU
    kernel accepts any capacity of at least the window (the slack spaces out its compactions),
    the CUDA kernel requires the capacity to equal the window.
    """

    provider: str
    device_type: str
    device_id: int
    session_providers: tuple[tuple[str, dict[str, str]], ...]
    host_visible: bool
    mask_policy: MaskPolicy
    cuda_graphs: bool = False
    specialize: bool = False
    window_slack: bool = True
    # The host-device traffic of this device's buffers and runs (`transfers`): one counter per
    # Device object, a fresh one for each `dataclasses.replace`.
    transfers: Transfers = dataclasses.field(default_factory=Transfers, init=False,
                                             compare=False, repr=False)

    @property
    def label(self) -> str:
        """"cpu" or "cuda:<id>", for logs and stats."""
        return "cpu" if self.device_type == "cpu" else f"{self.device_type}:{self.device_id}"

    def run(self, session: ort.InferenceSession, binding: ort.IOBinding,
            options: ort.RunOptions | None, then: Callable[[], T] | None = None) -> T | None:
        """One forward of `session` with everything bound through `binding`; `then`'s result.

        Off the host, the inputs were written by synchronous copies on CUDA's legacy stream,
        which ONNX Runtime's non-blocking streams do not wait for: `synchronize_inputs` makes
        them visible first (as ONNX Runtime's own CUDA graph tests do before each run). A
        capturing session runs one run at a time (`run_lock`), and `then` (what reads and lets
        go the outputs ONNX Runtime allocated for this run) runs under the same lock: no replay
        of that session can write into its arena before they are read. A run without options
        on a capturing session runs uncaptured (`run_lock.options_for`), never under graph 0.
        """
        with run_lock(session):
            if not self.host_visible:
                binding.synchronize_inputs()
                self.transfers.synchronized()
            session.run_with_iobinding(binding, options_for(session, options))
            return None if then is None else then()

    def providers(self, capture: bool = False) -> list[tuple[str, dict[str, str]]]:
        """The provider list of a session; `capture` turns CUDA graph capture on for it."""
        providers = [(name, {**options, **_CUDA_SESSION_OPTIONS} if name == _CUDA_EP
                      else dict(options)) for name, options in self.session_providers]
        if capture:
            name, options = providers[0]
            if name != _CUDA_EP:
                raise ConfigError(f"CUDA graph capture needs the CUDA provider, the device "
                                  f"{self.label} runs {name}")
            options[_ENABLE_CUDA_GRAPH] = "1"
        return providers


def device_for(provider: str, device_id: int = 0,
               mask_policy: MaskPolicy | str | None = None,
               cuda_graphs: bool | None = None) -> Device:
    """The device of a concrete provider ("cpu" or "cuda"), without checking that it works.

    `cuda_graphs` (default: on for CUDA) asks for CUDA graph capture; it takes effect only with
    the capacity mask, the one that keeps every input's shape fixed.
    """
    if provider == "cpu":
        if cuda_graphs:
            raise ConfigError("CUDA graphs were asked for on the CPU provider; use --provider "
                              "cuda or leave CUDA graphs off")
        device = Device("cpu", "cpu", 0, ((_CPU_EP, {}),), True, MaskPolicy.LOGICAL)
    elif provider == "cuda":
        options = {"device_id": str(device_id)}
        device = Device("cuda", "cuda", device_id, ((_CUDA_EP, options), (_CPU_EP, {})), False,
                        MaskPolicy.CAPACITY, cuda_graphs=True, specialize=False,
                        window_slack=False)
    else:
        raise ConfigError(f"unknown provider {provider!r}; expected 'cpu' or 'cuda'")
    policy = device.mask_policy
    if mask_policy is not None:
        try:
            policy = MaskPolicy(mask_policy)
        except ValueError as error:
            raise ConfigError(f"unknown mask policy {mask_policy!r}; expected 'logical' or "
                              "'capacity'") from error
    graphs = device.cuda_graphs if cuda_graphs is None else cuda_graphs
    if graphs and policy is not MaskPolicy.CAPACITY:
        if cuda_graphs:
            raise ConfigError("CUDA graphs need the capacity-wide mask (every input's shape "
                              "fixed); drop mask_policy='logical' or switch CUDA graphs off")
        graphs = False
    return dataclasses.replace(device, mask_policy=policy, cuda_graphs=graphs)


def resolve_device(provider: str = "auto", device_id: int = 0,
                   mask_policy: MaskPolicy | str | None = None,
                   cuda_graphs: bool | None = None) -> Device:
    """The device for `provider`: "auto" (CUDA when it works here, else CPU), "cuda" or "cpu".

    onnxruntime-gpu lists the CUDA provider as available even on machines without a GPU, so
    CUDA counts as working only when a session created with it reports it in get_providers().
    "cuda" on a machine where that fails is a ProviderError, never a silent fallback.
    """
    if provider not in PROVIDER_CHOICES:
        raise ConfigError(f"unknown provider {provider!r}; expected one of "
                          f"{', '.join(PROVIDER_CHOICES)}")
    if provider == "cpu":
        return device_for("cpu", mask_policy=mask_policy, cuda_graphs=cuda_graphs or None)
    failure = cuda_failure(device_id)
    if failure is None:
        chosen = device_for("cuda", device_id, mask_policy, cuda_graphs)
    elif provider == "cuda":
        raise ProviderError(
            f"the CUDA provider was asked for but cannot run on this machine (device "
            f"{device_id}): {failure}; use --provider cpu (or auto) here")
    else:
        chosen = device_for("cpu", mask_policy=mask_policy)
    logger.info("provider %s -> %s (%s mask, CUDA graphs %s)%s", provider, chosen.label,
                chosen.mask_policy.value, "on" if chosen.cuda_graphs else "off",
                "" if failure is None else f"; CUDA unusable: {failure}")
    return chosen


@functools.cache
def cuda_failure(device_id: int) -> str | None:
    """None when a CUDA session can be created on `device_id`, else why it cannot; probed once
    per device and process (`cuda_failure.cache_clear()` probes again)."""
    return probe_cuda(device_id)


def probe_cuda(device_id: int = 0, *, quiet: bool = True) -> str | None:
    """None when a CUDA session can be created on `device_id`, else why it cannot.

    `quiet=False` lets ONNX Runtime's loader print its failures to file descriptor 2 (what the
    GPU check shows when the probe fails); the runtime's own probe is quiet and cached.
    """
    if _CUDA_EP not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider"
    with _quiet_stderr() if quiet else contextlib.nullcontext():
        return _probe_cuda(device_id)


def _probe_cuda(device_id: int) -> str | None:
    _preload_cuda_libraries()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    # The provider factory logs its failure through the default logger before any session
    # option applies; the reason is returned instead, so quieten it for the probe only.
    ort.set_default_logger_severity(4)
    try:
        session = ort.InferenceSession(
            PROBE_MODEL, options,
            providers=[(_CUDA_EP, {"device_id": str(device_id)}), _CPU_EP])
    except Exception as error:  # ORT raises its own exception types, one per failure
        return f"creating a CUDA session failed ({error})"
    finally:
        ort.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)
    if session.get_providers()[0] != _CUDA_EP:
        return "ONNX Runtime fell back to the CPU provider (no usable GPU or CUDA libraries)"
    return None


def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* wheels, where ONNX Runtime can.

    onnxruntime-gpu 1.31 has `preload_dlls()`, which loads the libraries that pip installed
    under `nvidia/` beside the onnxruntime package (the loader does not search there by
    itself). Older builds lack it and rely on the system's library path. It prints what it
    cannot load; that goes to the log, not to the caller's output.
    """
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            preload()
    except Exception as error:  # a missing library is reported by the probe session instead
        logger.debug("onnxruntime.preload_dlls() failed: %s", error)
    if printed.getvalue().strip():
        logger.debug("onnxruntime.preload_dlls(): %s", printed.getvalue().strip())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null for the block (what C++ code prints goes nowhere)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
