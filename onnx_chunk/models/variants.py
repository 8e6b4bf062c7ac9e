"""The reference decoder variants: what each one changes in the base graph."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_chunk.errors import ConfigError


@dataclass(frozen=True)
class VariantSpec:
    """Graph features of one variant; the base decoder has every flag off."""

    name: str
    int4: bool = False
    position_ids: bool = False
    inputs_embeds: bool = False
    last_token_logits: bool = False
    conv_hybrid: bool = False
    odd_port: bool = False


_SPECS = (
    VariantSpec("base"),
    VariantSpec("int4", int4=True),
    VariantSpec("position_ids", position_ids=True),
    VariantSpec("inputs_embeds", inputs_embeds=True),
    VariantSpec("last_token_logits", last_token_logits=True),
    VariantSpec("conv_hybrid", conv_hybrid=True),
    VariantSpec("odd_port", odd_port=True),
)

VARIANTS: tuple[str, ...] = tuple(spec.name for spec in _SPECS)

# Name of the odd_port variant's extra input: a 1-D [sequence_length] float scale per row.
ROW_SCALE_INPUT = "row_scale"


def variant_spec(name: str) -> VariantSpec:
    """The spec of variant `name`; ConfigError names the known variants otherwise."""
    for spec in _SPECS:
        if spec.name == name:
            return spec
    raise ConfigError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
