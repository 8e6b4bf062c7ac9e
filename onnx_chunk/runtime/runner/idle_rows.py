"""Idle rows of a batched forward: rows that run but must be left as they were.

A batched decode runs one row per slot of the engine, and a row that does not decode this step
(a free slot, a slot between prefill chunks) still runs. The model runner leaves it as it was:
1. its KV write lands at its own length, which its next forward overwrites (a free slot:
   position 0, written again by its first prefill chunk);
2. its recurrent state is put back as it was (`BatchBuffers.keep_state`);
3. a window-sized KV cache (sliding_window_cache) evicts once its total passes its rows, which
   no later forward undoes: the rows of such a cache that one more position would make evict
   are saved before the forward and written back after it (`evicting_rows`).

Batched inputs: `input_ids [slots, 1]` (or `inputs_embeds [slots, 1, hidden]`),
`position_ids [slots, 1]` (each row at its own length), the KV buffers
`[slots, kv_heads, capacity, head]` bound whole as past and present, and an attention mask
whose row `i` holds `length_i + 1` ones: GroupQueryAttention derives each row's seqlens_k from
its row sum, so each row reads its own prefix and writes its new KV entry at its own length.
"""

from __future__ import annotations


def evicting_rows(lengths: list[int], idle: list[int], rows: int, window: int | None) -> list[int]:
    """The idle rows whose window-sized cache (of `rows` rows) one more position would evict."""
    if window is None:
        return []
    return [row for row in idle if lengths[row] > 0 and lengths[row] + 1 > rows]
