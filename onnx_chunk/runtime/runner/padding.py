"""The padding plan: a forward's real rows widened to a ladder tier, and its logits cut back.

Remainder chunks reuse the ladder's variants instead of building one per width: a chunk of
`rows` real rows runs at `padded_width(rows, tiers, room)`;
the extra rows repeat the last real token (or embedding row), every other per-token port
([1, rows, ...]) is widened the same way, and position_ids continue the sequence (past + i).
Padded rows cannot change a real result: they sit after every real row, so the causal mask
hides them from the real rows; their logits are cut off before anyone sees them; and the runtime
rewinds the logical length to past + real rows, so the next forward overwrites their KV entries.

Padding is refused (see `resolve_padding`) for models whose plan says so (recurrent or conv
state, which no mask protects and no logical length rewinds; a request input that is not
per-token), when switched off by the environment or by the caller. A model that shrinks the
query axis (returns fewer logits rows than query rows) is caught at run time by `cut_logits`,
which raises `QueryAxisShrunk`: the runtime then switches padding off for good and reruns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from onnx_chunk.errors import CapacityError, ConfigError, InputError, ModelStructureError
from onnx_chunk.ladder import padded_width

# Either variable set to an off value switches padding off (the second is the seed's own name,
# honoured so that deployments tuned for onnxruntime-genai keep their setting).
PADDING_ENV_VARS = ("ONNX_CHUNK_PREFILL_QUERY_PADDING", "ONNX_GENAI_PREFILL_QUERY_PADDING")
_OFF_VALUES = frozenset({"0", "false", "off", "no"})
_ON_VALUES = frozenset({"1", "true", "on", "yes", ""})


class Eligibility(Protocol):
    """What the passes record about a model (onnx_chunk.graph.chunk_plan.PaddingEligibility)."""

    @property
    def eligible(self) -> bool: ...

    @property
    def reasons(self) -> tuple[str, ...]: ...


class QueryAxisShrunk(ModelStructureError):
    """A padded forward returned fewer logits rows than it was given query rows.

    The model reduces the query axis inside the graph (for example it keeps only the last row),
    so its rows cannot be mapped back to input positions and padded rows would leak into the
    result. The runtime catches this, switches padding off for the model and reruns unpadded.
    """

    def __init__(self, returned_rows: int, query_rows: int, real_rows: int) -> None:
        self.returned_rows = returned_rows
        self.query_rows = query_rows
        self.real_rows = real_rows
        super().__init__(
            f"a padded forward of {query_rows} query rows ({real_rows} real) returned "
            f"{returned_rows} logits rows: the model shrinks the query axis, so its rows cannot "
            "be mapped back to input positions; padding is switched off for this model and the "
            "forward reruns unpadded")


@dataclass(frozen=True)
class PaddedForward:
    """One forward's inputs at its query width, and how to read its logits back.

    `tokens` is [width] token ids or [width, hidden] embeddings; `ports` holds every other
    per-token port as [1, width, ...]. When `width == real_rows` the arrays are the caller's own.
    """

    real_rows: int
    width: int
    past: int
    tokens: np.ndarray
    ports: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def padded(self) -> bool:
        """Whether the forward carries padded rows."""
        return self.width > self.real_rows

    @property
    def next_past(self) -> int:
        """The logical length after the forward: past + real rows (padded rows rewound)."""
        return self.past + self.real_rows

    def cut_logits(self, logits: np.ndarray) -> np.ndarray:
        """The logits of the real rows, from the forward's [1, rows, vocab] output.

        Rules:
        1. As many rows as the query width: the first `real_rows` rows.
        2. Fewer rows from a padded forward: `QueryAxisShrunk` (the self-check).
        3. Fewer rows from an unpadded forward (a model that keeps only the last row): all of
           them, since every query row was real.
        4. More rows than the query width: ModelStructureError.
        """
        if logits.ndim != 3 or logits.shape[0] != 1:
            raise ModelStructureError(
                f"expected logits shaped [1, rows, vocab], got {list(logits.shape)}; the model's "
                "logits output does not have the decoder layout")
        rows = logits.shape[1]
        if rows == self.width:
            return logits[:, : self.real_rows]
        if rows > self.width:
            raise ModelStructureError(
                f"a forward of {self.width} query rows returned {rows} logits rows; expected at "
                "most one row per query row")
        if self.padded:
            raise QueryAxisShrunk(rows, self.width, self.real_rows)
        return logits


def plan_forward(
    tokens: np.ndarray,
    ports: Mapping[str, np.ndarray] | None = None,
    *,
    past: int,
    tiers: Sequence[int],
    room: int | None = None,
    position_ids: str | None = None,
    enabled: bool = True,
    even: bool = False,
) -> PaddedForward:
    """Widen one forward's inputs to its padded width.

    `tokens` holds the real rows ([rows] ids or [rows, hidden] embeddings); `ports` the other
    per-token ports ([1, rows, ...]), `position_ids` naming the one among them that carries
    positions; `past` the logical length before the forward; `room` the positions left before
    the KV capacity (None: unbounded). With `enabled=False` nothing is padded but what
    `even` asks for.

    Rules:
    1. width = padded_width(rows, tiers, room) when enabled, else rows; with `even` (exact
       mode) then `even_width(width, room)`.
    2. Padded token rows repeat the last real row; so do the padded rows of every port...
    3. ...except `position_ids`, whose padded rows continue the sequence: past + i.
    """
    ports = dict(ports or {})
    rows = _rows_of(tokens, ports)
    if past < 0:
        raise InputError(f"the past length must be at least 0, got {past}")
    if room is not None and room < rows:
        raise CapacityError(
            f"a forward of {rows} rows at past length {past} needs {rows} positions but only "
            f"{room} are left before the KV capacity; shorten the request or raise the capacity")
    if position_ids is not None and position_ids not in ports:
        raise InputError(
            f"position_ids port {position_ids!r} is not among the per-token ports given "
            f"({sorted(ports)}); pass its array or name no position_ids port")
    width = padded_width(rows, tiers, room) if enabled else rows
    if even:
        width = even_width(width, room)
    extra = width - rows
    if extra == 0:
        return PaddedForward(rows, width, past, tokens, ports)
    padded_tokens = np.concatenate([tokens, np.repeat(tokens[-1:], extra, axis=0)], axis=0)
    padded_ports = {}
    for name, array in ports.items():
        if name == position_ids:
            tail = np.arange(past + rows, past + width, dtype=array.dtype).reshape(1, extra)
        else:
            tail = np.repeat(array[:, -1:], extra, axis=1)
        padded_ports[name] = np.concatenate([array, tail], axis=1)
    return PaddedForward(rows, width, past, padded_tokens, padded_ports)


def even_width(width: int, room: int | None) -> int:
    """The width of a prompt forward in exact mode: an odd width of more than one row gets one
    padded row more (CapacityError when no position is left for it).

    ONNX Runtime's CPU GroupQueryAttention computes a forward's query rows in blocks from its
    first row (2 x head size rows each), and a block of one row takes MLAS's one-row GEMM,
    which sums in another order: the last row of a forward of k x block + 1 rows differs in
    its last bits from the same row computed beside others (docs/row_grouping.md). A forward
    of an even number of rows never leaves a row alone in a block of an even size. One row
    runs as it is: the decode width, and a prompt's only row from an empty cache, which
    attends to itself alone.
    """
    if width == 1 or width % 2 == 0:
        return width
    if room is not None and width + 1 > room:
        raise CapacityError(
            f"exact mode pads a forward of {width} rows to {width + 1} (an even width), and only "
            f"{room} positions are left before the KV capacity; raise the capacity by one or "
            "shorten the request")
    return width + 1


def resolve_padding(
    plan_padding: Eligibility,
    requested: bool | None = None,
    env: Mapping[str, str] | None = None,
    default: bool = True,
) -> tuple[bool, str | None]:
    """Whether padding runs for a model, and the reason when it does not.

    Rules, first match wins:
    1. The model's plan refuses it (recurrent/conv state, a request input that is not
       per-token): off, with the plan's reasons. No argument can force unsafe padding.
    2. The caller asked (`requested` True or False): that.
    3. Either environment variable of PADDING_ENV_VARS set to 0/false/off/no: off.
    4. Either set to 1/true/on/yes (or empty): on.
    5. Otherwise `default`: on where per-width variants exist, off for a runtime of one
       shape-generic session (there a padded chunk only computes more rows; docs/runtime.md).
    Environment values other than 0/false/off/no/1/true/on/yes (or empty) are a ConfigError.
    """
    env = os.environ if env is None else env
    flags = {name: _env_flag(name, env[name]) for name in PADDING_ENV_VARS if name in env}
    switched_off = [name for name, flag in flags.items() if not flag]
    if not plan_padding.eligible:
        reasons = "; ".join(plan_padding.reasons) or "the model's plan does not allow padding"
        return False, f"refused by the model: {reasons}"
    if requested is not None:
        return (True, None) if requested else (False, "switched off by the caller")
    if switched_off:
        return False, f"switched off by {switched_off[0]}={env[switched_off[0]]}"
    if flags or default:
        return True, None
    return False, "off by default for the one shape-generic session (no per-width variants)"


def _env_flag(name: str, value: str) -> bool:
    word = value.strip().lower()
    if word in _OFF_VALUES:
        return False
    if word in _ON_VALUES:
        return True
    raise ConfigError(f"{name}={value!r} is not understood; expected 0 (padding off) or 1 (on)")


def _rows_of(tokens: np.ndarray, ports: Mapping[str, np.ndarray]) -> int:
    if tokens.ndim not in (1, 2) or tokens.shape[0] < 1:
        raise InputError(
            f"expected the chunk's tokens as [rows] ids or [rows, hidden] embeddings with at "
            f"least one row, got shape {list(tokens.shape)}")
    rows = tokens.shape[0]
    for name, array in ports.items():
        if array.ndim < 2 or array.shape[0] != 1 or array.shape[1] != rows:
            raise InputError(
                f"per-token port {name!r} must be shaped [1, {rows}, ...] like the chunk's "
                f"{rows} rows, got {list(array.shape)}")
    return rows
