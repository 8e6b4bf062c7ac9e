"""`onnx-chunk demo`: build, convert and run the reference decoder on a prompt over a chunk long."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from onnx_chunk.errors import ConfigError
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.models import PRESETS, build_decoder
from onnx_chunk.passes import convert_model
from onnx_chunk.runtime import GenerationStats, RuntimeStats, load
from onnx_chunk.runtime.caches.variant_cache import CacheStats
from onnx_chunk.runtime.device.provider import PROVIDER_CHOICES


def _chunks(generation: GenerationStats) -> str:
    return ", ".join(f"{c.rows}" if c.rows == c.width else f"{c.rows}->{c.width}"
                     for c in generation.chunks)


@dataclass
class _Run:
    """One configuration's run of the two prompts."""

    title: str
    tokens: list[int]
    first: GenerationStats
    second: GenerationStats
    after_first: CacheStats
    stats: RuntimeStats
    kv_bytes: int


def _run(converted: Path, provider: str, specialize: bool | None, prompts: list[list[int]],
         max_new_tokens: int) -> _Run:
    runtime = load(converted, provider=provider, specialize=specialize)
    for request in prompts:
        if len(request) + max_new_tokens > runtime.stats.capacity:
            raise ConfigError(f"a {len(request)}-token prompt plus {max_new_tokens} new "
                              f"tokens exceeds the model's {runtime.stats.capacity} positions; "
                              "use a smaller --prompt-tokens")
    sequence = runtime.open_sequence()
    tokens = sequence.generate(prompts[0], max_new_tokens)
    after_first = runtime.stats.cache
    again = runtime.open_sequence()
    again.generate(prompts[1], max_new_tokens)
    stats = runtime.stats
    title = ("per-width variants" if stats.specialize else "one shape-generic session")
    if specialize is None:
        title += " (provider default)"
    first, second = sequence.stats.last_generation, again.stats.last_generation
    assert first is not None and second is not None  # set by each generate()
    return _Run(title, tokens, first, second, after_first, stats, sequence.stats.kv_bytes)


def _column(run: _Run, expected: list[int]) -> list[str]:
    stats, cache, first, second = run.stats, run.stats.cache, run.first, run.second
    speed = first.decode_tokens_per_s
    return [
        f"{stats.provider} ({stats.device}), {stats.mask_policy}-width mask",
        f"{stats.capacity} positions, KV {run.kv_bytes} bytes",
        f"{', '.join(map(str, stats.ladder))}, padding "
        f"{stats.padding}",
        f"{first.prompt_tokens} tokens -> chunks {_chunks(first)}",
        f"{first.ttft_s * 1000:.1f} ms",
        f"{'-' if speed is None else f'{speed:.1f}'} tokens/s ({first.new_tokens} tokens)",
        f"compiles {run.after_first.compiles}, hits {run.after_first.hits}, evictions "
        f"{run.after_first.evictions}, variants {run.after_first.variants}, widths "
        f"{', '.join(map(str, run.after_first.widths))}",
        f"{second.prompt_tokens} tokens -> chunks {_chunks(second)}, TTFT "
        f"{second.ttft_s * 1000:.1f} ms, new compiles "
        f"{cache.compiles - run.after_first.compiles}",
        " ".join(map(str, run.tokens)),
        "greedy tokens equal a whole-prompt forward" if run.tokens == expected
        else f"MISMATCH: a whole-prompt forward gives {' '.join(map(str, expected))}",
    ]


_ROWS = ("provider", "capacity", "ladder", "prompt", "TTFT", "decode", "cache", "2nd prompt",
         "tokens", "check")


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=1137, show_default=True)
@click.option("--chunk-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--specialize/--no-specialize", default=None,
              help="Run only per-width variants (the ladder's sessions) or only one "
                   "shape-generic session (default: the provider's default, and per-width "
                   "variants beside it when the default is one session).")
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

        vocab = PRESETS[preset].vocab_size
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, vocab, prompt_tokens).tolist(),
                   rng.integers(0, vocab, prompt_tokens + 7).tolist()]
        runs = [_run(converted, provider, specialize, prompts, max_new_tokens)]
        if specialize is None and not runs[0].stats.specialize:
            # The ladder and the variant cache are what CUDA runs; show them here too.
            runs.append(_run(converted, provider, True, prompts, max_new_tokens))

        whole = load(converted, provider=provider, chunk_size=runs[0].stats.capacity,
                     padding=False)
        expected = whole.open_sequence().generate(prompts[0], max_new_tokens)

    click.echo(f"reference decoder, preset {preset}, converted at chunk {chunk_size}; "
               f"prompts of {len(prompts[0])} and {len(prompts[1])} tokens")
    columns = [_column(run, expected) for run in runs]
    width = max(len(name) for name in _ROWS)
    for run, column in zip(runs, columns):
        click.echo(f"\n== {run.title}")
        for name, value in zip(_ROWS, column):
            click.echo(f"{name:<{width}}  {value}")
    if any(run.tokens != expected for run in runs):
        ctx.exit(1)
