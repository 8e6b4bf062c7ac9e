"""Does the variant cache still build variants once the prompts repeat? (a per-shape cache
rebuilds on every request; the ladder's bounded widths stop that)

Five prompts of different lengths, whose last chunks leave five different remainders, each run
twice in one runtime, in three modes:

- padding off, one variant per exact width (`specialize="exact"`): the per-shape cache of the
  seed's section three, which thrashes once the widths outnumber the cap;
- padding off, ladder keys: what a padding-refused model gets — widths off the ladder share one
  shape-generic variant, so nothing is rebuilt, but remainders run unspecialised;
- padding on: remainders rounded up the ladder.

Every prefill forward is printed with its real rows, the width it ran at, the variants it built
and the evictions so far (a prompt's decode steps form one row of width 1): the script feeds a
prompt one `Sequence.prefill` call per chunk of W rows, so that each forward's counters show,
takes the first token from the last chunk's logits (which the modes compare) and generates the
rest with `Sequence.generate`. Then each run's
end-to-end time and whether the modes agree: each prompt's last prefill logits within
`--logits-rtol` of the largest |logit| (float16 kernels tile differently per width, so exact
tokens can flip on a near tie; the tokens are reported beside). The KV capacity is the model's,
so no chunk runs near capacity (where a remainder whose tier would not fit runs at its exact
width).

Expected: padding off with exact keys keeps building in the second pass, evictions climbing;
padding on builds nothing in the second pass and never holds more than the cap.

    .venv/bin/python scripts/cache_thrash.py [--model PATH] [--chunk-size 64] [--provider cpu]
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

import onnx_chunk
from onnx_chunk.models import build_decoder

DEFAULT_LENGTHS = (104, 146, 311, 378, 229)


@dataclass
class _Forward:
    prompt: int
    rows: int
    width: int
    built: int
    evictions: int


@dataclass
class _Pass:
    forwards: list[_Forward] = field(default_factory=list)
    seconds: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def built(self) -> int:
        return sum(forward.built for forward in self.forwards)


def _run_prompt(runtime, ids: np.ndarray, new_tokens: int, record: _Pass) -> None:
    """Greedy generation with one `prefill` call per chunk, so each forward's counters show."""
    sequence = runtime.open_sequence()
    start = time.perf_counter()
    logits = None
    width = runtime.stats.chunk_size
    for begin in range(0, len(ids), width):
        end = min(begin + width, len(ids))
        before = runtime.debug.cache.snapshot()
        padded_before = sequence.stats.padded_rows
        logits = sequence.prefill(ids[begin:end])
        after = runtime.debug.cache.snapshot()
        rows = end - begin
        record.forwards.append(_Forward(len(ids), rows,
                                        rows + sequence.stats.padded_rows - padded_before,
                                        after.compiles - before.compiles, after.evictions))
    assert logits is not None  # the prompt has at least one chunk
    record.logits[len(ids)] = np.asarray(logits, dtype=np.float32)
    tokens = [int(np.argmax(logits))]
    before = runtime.debug.cache.snapshot()
    if new_tokens > 1:
        # The first token as a one-token prompt: a forward at the decode width, as a decode step.
        tokens += sequence.generate(tokens, new_tokens - 1, eos_token_id=[])
    after = runtime.debug.cache.snapshot()
    # The decode steps, as one row: a decode variant evicted by a remainder is rebuilt here.
    record.forwards.append(_Forward(len(ids), 1, 1, after.compiles - before.compiles,
                                    after.evictions))
    record.seconds[len(ids)] = time.perf_counter() - start
    record.tokens[len(ids)] = tokens


# title -> (padding, specialize)
MODES = {
    "padding off, exact-width keys (per-shape cache)": (False, "exact"),
    "padding off, ladder keys (a padding-refused model)": (False, True),
    "padding on": (True, True),
}


def _run_mode(model: Path, padding: bool, specialize, lengths, chunk_size: int, cap: int,
              provider: str, new_tokens: int):
    runtime = onnx_chunk.load(model, provider=provider, chunk_size=chunk_size,
                              max_variants=cap, padding=padding, specialize=specialize)
    passes = [_Pass(), _Pass()]
    for record in passes:
        for length in lengths:
            ids = np.random.default_rng(length).integers(0, runtime.stats.vocab_size, length)
            _run_prompt(runtime, ids, new_tokens, record)
    return runtime, passes


def _print_mode(title: str, runtime, passes: list[_Pass]) -> None:
    click.echo(f"\n== {title} (provider {runtime.stats.provider}, W={runtime.stats.chunk_size}, "
               f"ladder {list(runtime.stats.ladder)}, cap {runtime.debug.cache.cap})")
    click.echo(f"{'pass':>4} {'prompt':>6} {'rows':>5} {'width':>5} {'built':>5} "
               f"{'evictions':>9}")
    for number, record in enumerate(passes, 1):
        for forward in record.forwards:
            click.echo(f"{number:>4} {forward.prompt:>6} {forward.rows:>5} {forward.width:>5} "
                       f"{forward.built:>5} {forward.evictions:>9}")
    for number, record in enumerate(passes, 1):
        times = ", ".join(f"{length}: {seconds * 1000:.1f} ms"
                          for length, seconds in record.seconds.items())
        total = sum(record.seconds.values()) * 1000
        click.echo(f"pass {number}: {record.built} variants built; wall {total:.1f} ms; "
                   f"end-to-end {times}")
    stats = runtime.debug.cache.snapshot()
    click.echo(f"cache: compiles {stats.compiles}, hits {stats.hits}, evictions "
               f"{stats.evictions}, peak variants {stats.peak_variants}/{stats.cap}, widths "
               f"{list(stats.widths)}, peak bytes held {stats.peak_bytes_held} ({stats.meter}), "
               f"padding refused: {stats.padding_refused}")


@click.command()
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A decoder to run (default: build the tiny reference decoder).")
@click.option("--chunk-size", default=64, show_default=True)
@click.option("--cap", default=4, show_default=True, help="Variant cache cap.")
@click.option("--provider", default="cpu", show_default=True)
@click.option("--new-tokens", default=8, show_default=True)
@click.option("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), show_default=True,
              help="Prompt lengths, comma separated.")
@click.option("--logits-rtol", default=1e-4, show_default=True,
              help="Allowed logits difference between modes, as a fraction of the largest "
                   "|logit| (1e-2 for float16 decoders).")
def main(model: Path | None, chunk_size: int, cap: int, provider: str, new_tokens: int,
         lengths: str, logits_rtol: float) -> None:
    prompt_lengths = tuple(int(length) for length in lengths.split(","))
    with tempfile.TemporaryDirectory() as folder:
        path = model or build_decoder(folder, preset="tiny")
        results = {}
        for title, (padding, specialize) in MODES.items():
            runtime, passes = _run_mode(path, padding, specialize, prompt_lengths, chunk_size,
                                        cap, provider, new_tokens)
            _print_mode(title, runtime, passes)
            results[title] = (runtime.debug.cache.snapshot(), passes)
    (exact_stats, exact_passes), (_, ladder_passes), (on_stats, on_passes) = results.values()
    same = all(a.tokens == b.tokens == c.tokens
               for a, b, c in zip(exact_passes, ladder_passes, on_passes))
    click.echo(f"\ngreedy tokens equal in all three modes: {same}")
    diff, scale = _logits_spread([exact_passes, ladder_passes, on_passes])
    allowed = logits_rtol * max(scale, 1.0)
    click.echo(f"last prefill logits across modes: max |diff| {diff:.2e} (scale {scale:.2f}, "
               f"allowed {allowed:.2e})")
    checks = {
        "exact keys without padding keep building in the second pass": exact_passes[1].built > 0,
        "exact keys without padding evict in the second pass":
            exact_passes[1].forwards[-1].evictions > exact_passes[0].forwards[-1].evictions,
        "ladder keys without padding build nothing in the second pass":
            ladder_passes[1].built == 0,
        "padding on builds nothing in the second pass": on_passes[1].built == 0,
        "padding on never holds more than the cap": on_stats.peak_variants <= on_stats.cap,
        "exact keys never hold more than the cap either":
            exact_stats.peak_variants <= exact_stats.cap,
        "last prefill logits agree across modes within the tolerance": diff <= allowed,
    }
    for check, passed in checks.items():
        click.echo(f"{'ok  ' if passed else 'FAIL'} {check}")
    sys.exit(0 if all(checks.values()) else 1)


def _logits_spread(modes: list[list[_Pass]]) -> tuple[float, float]:
    """The largest logits difference of any mode from the first, and the largest |logit|."""
    reference = modes[0]
    diff = scale = 0.0
    for passes in modes:
        for ours, theirs in zip(passes, reference):
            for length, logits in ours.logits.items():
                diff = max(diff, float(np.abs(logits - theirs.logits[length]).max()))
                scale = max(scale, float(np.abs(logits).max()))
    return diff, scale


if __name__ == "__main__":
    main()
