"""The names of every validation check, grouped, and how `--skip` selects among them."""

from __future__ import annotations

from collections.abc import Iterable

from onnx_chunk.errors import ConfigError

STRUCTURE = "structure"
NUMERICS = "numerics"
CACHE = "cache"
ENGINE = "engine"
STATIC = "static"
REFERENCE = "reference"

# Group -> its checks, in the order they are reported. A check's full name is group.check.
CHECKS: dict[str, tuple[str, ...]] = {
    STRUCTURE: ("checker", "external_data", "gqa", "kv_capacity", "per_token_ports",
                "recurrent_state", "padding", "metadata", "ladder"),
    NUMERICS: ("greedy_tokens", "logits", "kv_prefix"),
    CACHE: ("second_pass", "variant_cap"),
    ENGINE: ("batched_decode",),
    STATIC: ("graph", "limits", "decode_graph", "chunked_vs_whole"),
    # Reported only when a reference model is given (--reference).
    REFERENCE: ("max_logits_diff", "greedy_agreement"),
}

# Structure checks that apply to a static (fixed-shape) decoder; the others read the dynamic
# decoder's chunked-prefill plan.
STATIC_STRUCTURE = ("checker", "external_data")


def full_name(group: str, check: str) -> str:
    return f"{group}.{check}"


def all_names() -> tuple[str, ...]:
    """Every check's full name."""
    return tuple(full_name(group, check) for group, checks in CHECKS.items() for check in checks)


def resolve_skip(selectors: Iterable[str]) -> frozenset[str]:
    """The full names of the checks that `--skip` selectors name.

    A selector is a group (`numerics`), a full check name (`structure.ladder`) or a bare check
    name (`ladder`). Unknown names are a ConfigError that lists the valid ones.
    """
    names = all_names()
    skipped: set[str] = set()
    for selector in selectors:
        key = selector.strip().lower()
        if key in CHECKS:
            skipped.update(full_name(key, check) for check in CHECKS[key])
            continue
        matches = [name for name in names if name == key or name.split(".", 1)[1] == key]
        if not matches:
            raise ConfigError(
                f"--skip {selector!r} names no check; expected a group ({', '.join(CHECKS)}) "
                f"or a check ({', '.join(names)})")
        skipped.update(matches)
    return frozenset(skipped)
