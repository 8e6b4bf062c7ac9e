"""The batched decode forward: one decode row of every slot in one run of the decode variant.

Inputs at a fixed batch width (the engine's slots): `input_ids [slots, 1]` (or
`inputs_embeds [slots, 1, hidden]`), `position_ids [slots, 1]` where the model takes them
(each row at its own length), the KV buffers `[slots, kv_heads, capacity, head]` of
`BatchBuffers` bound whole as past and present, and an attention mask whose row `i` holds
`length_i + 1` ones and zeros after: GroupQueryAttention derives each row's seqlens_k from its
row sum, so each row reads its own prefix and writes its new KV entry at its own length.
The mask policy's `set_rows` writes it (`attention_mask`): as wide as the longest row needs
under the logical policy, capacity-wide under the capacity policy.

Rows that do not decode this step (a free slot, a slot between prefill chunks) still run:
1. their KV write lands at their own length, which their next forward overwrites (a free
   slot: position 0, written again by its first prefill chunk);
2. their recurrent state is put back as it was (`BatchBuffers.keep_state`);
3. a window-sized KV cache (sliding_window_cache) evicts once its total passes its rows, which
   no later forward undoes: the rows of such a cache that one more position would make evict
   are saved before the forward and written back after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.attention_mask import AttentionMask
from onnx_chunk.runtime.buffers import BatchBuffers, DeviceBuffer, device_zeros
from onnx_chunk.runtime.cuda_graphs import session_captures, uncaptured
from onnx_chunk.runtime.ports import LOGITS_OUTPUT, ModelPorts
from onnx_chunk.runtime.provider import Device

BATCH_BINDING = "batch"


@dataclass
class DecodeBinding:
    """The batched decode's IOBinding on one session (kept with the session's other bindings,
    which release the graphs they captured: this one captures none)."""

    io: ort.IOBinding
    graphs: None = None


def evicting_rows(lengths: list[int], idle: list[int], rows: int, window: int | None) -> list[int]:
    """The idle rows whose window-sized cache (of `rows` rows) one more position would evict."""
    if window is None:
        return []
    return [row for row in idle if lengths[row] > 0 and lengths[row] + 1 > rows]


class BatchDecoder:
    """Runs the decode forward of every slot of a `BatchBuffers` (see the module docstring)."""

    def __init__(self, ports: ModelPorts, device: Device, buffers: BatchBuffers,
                 embeddings: np.ndarray | None, mask: AttentionMask) -> None:
        """`mask`: a `[slots, capacity]` mask of the runtime's mask policy."""
        self.ports = ports
        self.device = device
        self.mask = mask
        self.buffers = buffers
        self.embeddings = embeddings
        self._no_capture = uncaptured().first
        slots = buffers.slots
        token_shape = ((slots, 1) if ports.hidden_size is None
                       else (slots, 1, ports.hidden_size))
        self._tokens = device_zeros(token_shape, ports.token_dtype, device)
        self._host_tokens = np.zeros(token_shape, dtype=ports.token_dtype)
        self._positions = (device_zeros((slots, 1), np.int64, device)
                           if ports.position_ids is not None else None)
        self._logits = device_zeros((slots, 1, ports.vocab_size), ports.logits_dtype, device)

    def binding(self, session: ort.InferenceSession, kept: dict) -> ort.IOBinding:
        """The decode binding on `session`, made once and kept in `kept` (dropped with it)."""
        found = kept.get(BATCH_BINDING)
        if found is not None:
            return found.io
        io = session.io_binding()
        io.bind_ortvalue_output(LOGITS_OUTPUT, self._logits.value)
        self.buffers.bind_kv(io)
        io.bind_ortvalue_input(self.ports.token_input, self._tokens.value)
        if self._positions is not None:
            io.bind_ortvalue_input(self.ports.position_ids, self._positions.value)
        self.mask.bind(io)
        kept[BATCH_BINDING] = DecodeBinding(io)
        return io

    def run(self, session: ort.InferenceSession, io: ort.IOBinding, lengths: list[int],
            tokens: list[int], decoding: list[int]) -> np.ndarray:
        """One forward: row i feeds `tokens[i]` at `lengths[i]`; rows outside `decoding` keep
        their state and window caches. The [slots, vocab] logits, on the host."""
        slots = self.buffers.slots
        active = set(decoding)
        idle = [row for row in range(slots) if row not in active]
        for row, token in enumerate(tokens):
            self._host_tokens[row, 0] = (token if self.embeddings is None
                                         else self.embeddings[token])
        self._tokens.write(self._host_tokens)
        if self._positions is not None:
            self._positions.write(np.asarray(lengths, dtype=np.int64).reshape(slots, 1))
        self.mask.set_rows(io, lengths)
        saved = self._save_windows(lengths, idle)
        self.buffers.bind_state(io)
        # The batched binding never captures a CUDA graph (a capturing session would take its
        # third run as a capture under graph 0, outside the capture gate and the state's parity).
        self.device.run(session, io, self._no_capture if session_captures(session) else None)
        self.buffers.keep_state(idle)
        self.buffers.swap_state()
        for buffer, row, array in saved:
            self.buffers.write_row(buffer, row, array)
        vocab = self.ports.vocab_size
        return self._logits.read(0, slots * vocab).reshape(slots, vocab)

    def _save_windows(self, lengths: list[int],
                      idle: list[int]) -> list[tuple[DeviceBuffer, int, np.ndarray]]:
        saved = []
        for port, buffer in zip(self.ports.kv, self.buffers.kv):
            for row in evicting_rows(lengths, idle, port.shape[2], port.window):
                saved.append((buffer, row, self.buffers.read_row(buffer, row)))
        return saved
