"""`onnx-chunk demo`: build, convert and run the reference decoder on a prompt over a chunk long."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path

import click
import numpy as np

from onnx_chunk.errors import ConfigError
from onnx_chunk.model_io import load_model, save_model
from onnx_chunk.models import PRESETS, build_decoder
from onnx_chunk.passes import convert_model
from onnx_chunk.runtime import GenerationStats, load
from onnx_chunk.runtime.provider import PROVIDER_CHOICES


def _chunks(generation: GenerationStats) -> str:
    return ", ".join(f"{c.rows}" if c.rows == c.width else f"{c.rows}->{c.width}"
                     for c in generation.chunks)


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=1137, show_default=True)
@click.option("--chunk-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--specialize/--no-specialize", default=None,
              help="Per-width variants (the ladder's sessions) or one shape-generic session "
                   "(default: the provider's; one session on CPU).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Keep the built models in this folder (default: a temporary folder).")
@click.pass_context
def demo(ctx: click.Context, preset: str, prompt_tokens: int, chunk_size: int,
         max_new_tokens: int, provider: str, seed: int, specialize: bool | None,
         out: Path | None) -> None:
    """Build, convert and run the default reference decoder; check it against one forward."""
    with ExitStack() as stack:
        folder = out if out is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="onnx-chunk-demo-")))
        exported = build_decoder(folder / "exported", preset=preset, seed=seed)
        model = load_model(exported)
        convert_model(model, chunk_size=chunk_size)
        converted = folder / "converted" / "model.onnx"
        save_model(model, converted)

        runtime = load(converted, provider=provider, specialize=specialize)
        vocab = runtime.ports.vocab_size
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, vocab, prompt_tokens).tolist()
        second_prompt = rng.integers(0, vocab, prompt_tokens + 7).tolist()
        for request in (prompt, second_prompt):
            if len(request) + max_new_tokens > runtime.capacity:
                raise ConfigError(f"a {len(request)}-token prompt plus {max_new_tokens} new "
                                  f"tokens exceeds the model's {runtime.capacity} positions; "
                                  "use a smaller --prompt-tokens")
        sequence = runtime.open_sequence()
        tokens = sequence.generate(prompt, max_new_tokens)
        first = sequence.stats.last_generation
        after_first = runtime.stats().cache
        again = runtime.open_sequence()
        again.generate(second_prompt, max_new_tokens)
        second = again.stats.last_generation
        stats = runtime.stats()

        whole = load(converted, provider=provider, chunk_size=runtime.capacity, padding=False)
        expected = whole.open_sequence().generate(prompt, max_new_tokens)

    cache = stats.cache
    speed = first.decode_tokens_per_s
    rows = [
        ("model", f"reference decoder, preset {preset}, converted at chunk {chunk_size}"),
        ("provider", f"{stats.provider} ({stats.device}), {stats.mask_policy}-width mask"),
        ("capacity", f"{stats.capacity} positions, KV {sequence.stats.kv_bytes} bytes"),
        ("ladder", f"{', '.join(map(str, stats.ladder))} (padding "
                   f"{'on' if stats.padding else 'off: ' + str(cache.padding_refused)})"),
        ("prompt", f"{len(prompt)} tokens -> chunks {_chunks(first)}"),
        ("TTFT", f"{first.ttft_s * 1000:.1f} ms"),
        ("decode", f"{'-' if speed is None else f'{speed:.1f}'} tokens/s "
                   f"({first.new_tokens} tokens)"),
        ("cache", f"compiles {after_first.compiles}, hits {after_first.hits}, evictions "
                  f"{after_first.evictions}, variants {after_first.variants}, widths "
                  f"{', '.join(map(str, after_first.widths))}"),
        ("2nd prompt", f"{len(second_prompt)} tokens -> chunks {_chunks(second)}, TTFT "
                       f"{second.ttft_s * 1000:.1f} ms, new compiles "
                       f"{cache.compiles - after_first.compiles}"),
        ("tokens", " ".join(map(str, tokens))),
        ("check", "greedy tokens equal a whole-prompt forward" if tokens == expected
         else f"MISMATCH: a whole-prompt forward gives {' '.join(map(str, expected))}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")
    if tokens != expected:
        ctx.exit(1)
