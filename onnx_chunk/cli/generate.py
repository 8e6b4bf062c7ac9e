"""`onnx-chunk generate`: greedy generation with chunked prefill, one runtime for all prompts.

On a dynamic decoder every prompt, whatever the flags, is a request on the engine's step
(`Runtime.submit`, through `_served`): token ids greedily here, text through the same submit
(`--prompt`, cli/text_generate.py). A static decoder runs on the static runner
(cli/static_generate.py).
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import click
import numpy as np

from onnx_chunk import arguments
from onnx_chunk.cli.json_output import dumps as json_dumps
from onnx_chunk.cli.progress import QUIET_OPTION, wanted
from onnx_chunk.cli.static_generate import run_static_generate
from onnx_chunk.cli.text_generate import (
    given_text_options,
    run_text_generate,
    text_options,
)
from onnx_chunk.errors import InputError
from onnx_chunk.graph.model_folder import check_utf8_path
from onnx_chunk.runtime import PROVIDER_CHOICES, Request, Runtime, RuntimeStats, load
from onnx_chunk.runtime.engine.speculation import SPECULATIVE_CHOICES
from onnx_chunk.static import is_static_model, load_static

_SEPARATORS = re.compile(r"[\s,]+")
# An integer in ASCII digits, with an optional sign: int() alone also takes other scripts'
# digits and underscores ("1_0").
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def parse_ids(text: str, where: str = "--ids") -> list[int]:
    """Token ids written as integers (ASCII digits) separated by commas and/or spaces."""
    words = [word for word in _SEPARATORS.split(text.strip()) if word]
    bad = next((word for word in words if not _INTEGER.fullmatch(word)), None)
    if bad is not None:
        raise InputError(f"{where}: expected integers (digits 0-9) separated by commas or "
                         f"spaces, got {bad!r} in {text.strip()!r}")
    return [int(word) for word in words]


def read_ids_file(path: Path) -> list[list[int]]:
    """One prompt per non-empty line of `path` (UTF-8 text)."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except OSError as error:
        raise InputError(f"cannot read the ids file {str(path)!r}: "
                         f"{error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise InputError(f"the ids file {str(path)!r} is not UTF-8 text (byte "
                         f"{error.start}); write one prompt per line as integers separated "
                         "by spaces or commas") from error
    prompts = [parse_ids(line, f"{path}:{number}") for number, line in enumerate(lines, 1)
               if line.strip()]
    if not prompts:
        raise InputError(f"the ids file {str(path)!r} holds no prompt; write one prompt per "
                         "line (integers separated by spaces or commas)")
    return prompts


def record(index: int, request: Request, stats: RuntimeStats) -> dict:
    """The JSON object printed for one prompt served one after another (--batch 1)."""
    counts = request.stats
    engine = stats.engine
    return {
        "prompt": index,
        "prompt_tokens": counts.prompt_tokens,
        "tokens": request.result(),
        "ttft_s": counts.ttft_s,
        "decode_tokens_per_s": counts.decode_tokens_per_s,
        "chunks": [[chunk.rows, chunk.width] for chunk in counts.chunks],
        "stopped_by_eos": request.finish_reason == "stop",
        "stats": {**_stats_entry(stats),
                  "draft_tokens": engine.draft_tokens if engine else 0,
                  "accepted_tokens": engine.accepted_tokens if engine else 0},
    }


def batch_record(index: int, request: Request, stats: RuntimeStats) -> dict:
    """The JSON object printed for one prompt served by the batch engine (--batch)."""
    tokens = request.result()
    counts = request.stats
    decode_s = (counts.total_s or 0.0) - (counts.ttft_s or 0.0)
    engine = stats.engine
    return {
        "prompt": index,
        "prompt_tokens": counts.prompt_tokens,
        "tokens": tokens,
        "ttft_s": counts.ttft_s,
        "decode_tokens_per_s": ((len(tokens) - 1) / decode_s
                                if len(tokens) > 1 and decode_s > 0 else None),
        "prefill_chunks": counts.prefill_chunks,
        "queued_s": counts.queued_s,
        "finish_reason": request.finish_reason,
        "stopped_by_eos": request.finish_reason == "stop",
        "stats": {**_stats_entry(stats), "max_batch": stats.max_batch,
                  "decode_steps": engine.decode_steps if engine else 0,
                  "rows_per_decode_step": engine.rows_per_decode_step if engine else None,
                  "draft_tokens": engine.draft_tokens if engine else 0,
                  "accepted_tokens": engine.accepted_tokens if engine else 0},
    }


def _stats_entry(stats: RuntimeStats) -> dict:
    cache = stats.cache
    return {
            "provider": stats.provider,
            "device": stats.device,
            "chunk_size": stats.chunk_size,
            "ladder": list(stats.ladder),
            "padding": stats.padding,
            "padding_refused": cache.padding_refused,
            "specialize": stats.specialize,
            "speculative": stats.speculative,
            "weights_bytes": stats.weights_bytes,
            "weights_shared": stats.weights_shared,
            "compiles": cache.compiles,
            "hits": cache.hits,
            "evictions": cache.evictions,
            "variants": cache.variants,
            "widths": list(cache.widths),
            "bytes_held": cache.bytes_held,
    }


def _format(entry: dict) -> str:
    stats = entry["stats"]
    speed = entry["decode_tokens_per_s"]
    chunks = (" ".join(f"{rows}->{width}" if rows != width else str(rows)
                       for rows, width in entry["chunks"]) if "chunks" in entry
              else f"{entry['prefill_chunks']} ({entry['finish_reason']})")
    return (f"prompt {entry['prompt']} ({entry['prompt_tokens']} tokens): "
            f"{' '.join(map(str, entry['tokens']))}\n"
            f"  chunks {chunks} | ttft {entry['ttft_s'] * 1000:.1f} ms | "
            f"decode {'-' if speed is None else f'{speed:.1f}'} tok/s | "
            f"compiles {stats['compiles']} hits {stats['hits']} "
            f"evictions {stats['evictions']} variants {stats['variants']} "
            f"widths {','.join(map(str, stats['widths']))}")


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--ids", "ids_text", help="The prompt's token ids: 1,2,3 or \"1 2 3\".")
@click.option("--ids-file", type=click.Path(path_type=Path),
              help="A file with one prompt per line; all run in order in one runtime.")
@click.option("--random-prompt", type=click.IntRange(min=1), metavar="N",
              help="A prompt of N random token ids.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of --random-prompt, and of sampling with --prompt (default there: "
                   "genai_config.json's random_seed).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), required=True)
@click.option("--eos-token-id", "eos_token_ids", type=int, multiple=True,
              help="Stop after this token; repeatable (stop at any of them).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Prefill chunk width (default: the model's declaration).")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True)
@click.option("--capacity", type=click.IntRange(min=2), default=None,
              help="KV capacity in positions (default: the model's maximum).")
@click.option("--no-padding", is_flag=True, help="Run remainder chunks at their own width.")
@click.option("--specialize/--no-specialize", default=None,
              help="One session per ladder width, or one shape-generic session (default: the "
                   "provider's: one session on CPU, per-width variants on CUDA).")
@click.option("--static", is_flag=True,
              help="Run MODEL as a static (fixed-shape) decoder; detected from the model too.")
@click.option("--max-input-len", type=click.IntRange(min=1), default=None,
              help="static: the longest prompt L (default: the largest multiple of c below C).")
@click.option("--kv-capacity", type=click.IntRange(min=1), default=None,
              help="static: the expected KV capacity C; must match the graph.")
@click.option("--decode-model", type=click.Path(path_type=Path), default=None,
              help="static: the rows-1 graph (default: decode.onnx beside MODEL).")
@click.option("--strict", is_flag=True,
              help="static: refuse truncation or a sliding cache instead of warning.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Serve the prompts through the batch engine, at most N at once (one "
                   "batched decode forward for all); 1 runs them one after another.")
@click.option("--speculative", type=click.Choice(SPECULATIVE_CHOICES), default=None,
              help="Draft tokens by prompt lookup and verify them in one forward (greedy "
                   "output unchanged, sampled output exact in distribution).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt per line.")
@QUIET_OPTION
@text_options
def generate(model: Path, ids_text: str | None, ids_file: Path | None,
             random_prompt: int | None, seed: int, max_new_tokens: int,
             eos_token_ids: tuple[int, ...], chunk_size: int | None, provider: str,
             capacity: int | None, no_padding: bool, specialize: bool | None, static: bool,
             max_input_len: int | None, kv_capacity: int | None, decode_model: Path | None,
             strict: bool, batch: int, speculative: str | None, as_json: bool, quiet: bool,
             **text: object) -> None:
    """Generate from MODEL with chunked prefill (dynamic or static decoders): token ids in and
    out greedily, or with --prompt text in, text streamed out (see docs/text.md)."""
    check_utf8_path(model)
    if text["prompt"] is not None:
        _refuse("--prompt", {"--batch": batch if batch > 1 else None})
        _route_text(model, text, ids_text, ids_file, random_prompt, seed, max_new_tokens,
                    eos_token_ids or None, chunk_size, provider, capacity, no_padding, specialize,
                    static, as_json, speculative, wanted(quiet))
        return
    _refuse("token ids", dict.fromkeys(given_text_options(text), True))
    given = [name for name, value in (("--ids", ids_text), ("--ids-file", ids_file),
                                      ("--random-prompt", random_prompt)) if value is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --ids, --ids-file, --random-prompt"
                               + (f" (got {', '.join(given)})" if given else ""))
    dynamic_only = {"--capacity": capacity, "--no-padding": no_padding or None,
                    "--specialize/--no-specialize": specialize,
                    "--batch": batch if batch > 1 else None, "--speculative": speculative}
    static_only = {"--max-input-len": max_input_len, "--kv-capacity": kv_capacity,
                   "--decode-model": decode_model, "--strict": strict or None}
    if static or is_static_model(model):
        _refuse("a static decoder", dynamic_only)
        runner = load_static(model, decode_model=decode_model, max_input_len=max_input_len,
                             chunk_size=chunk_size, kv_capacity=kv_capacity, provider=provider,
                             strict=strict)
        prompts = _prompts(runner.vocab_size, ids_text, ids_file, random_prompt, seed)
        stop = arguments.token_ids(eos_token_ids, "--eos-token-id", runner.vocab_size)
        run_static_generate(runner, prompts, max_new_tokens=max_new_tokens, eos_token_id=stop,
                            as_json=as_json, echo=click.echo)
        return
    _refuse("a dynamic decoder", static_only)
    # One after another, each prompt is prefilled from an empty cache (what its chunks and
    # ttft measure); batched, the engine keeps prompt prefixes for later requests, as `serve`.
    with load(model, provider=provider, capacity=capacity, chunk_size=chunk_size,
              padding=False if no_padding else None, specialize=specialize,
              max_batch=batch, speculative=speculative, prefix_reuse=batch > 1) as runtime:
        prompts = _prompts(runtime.stats.vocab_size, ids_text, ids_file, random_prompt, seed)
        stop = arguments.token_ids(eos_token_ids, "--eos-token-id", runtime.stats.vocab_size)
        # Every prompt is checked before any runs, so a bad line N does not fail after N - 1
        # were served.
        for prompt in prompts:
            runtime.check_request(prompt, max_new_tokens)
        if not as_json:
            stats = runtime.stats
            click.echo(f"provider {stats.provider} ({stats.device}), capacity {stats.capacity}, "
                       f"chunk {stats.chunk_size}, ladder {','.join(map(str, stats.ladder))}, "
                       f"padding {stats.padding}, "
                       + ("one shape-generic session" if stats.specialize is False
                          else "variants per width"))
        entry_of = record if batch == 1 else batch_record
        for index, request in enumerate(_served(runtime, prompts, max_new_tokens, stop or None,
                                                batch)):
            entry = entry_of(index, request, runtime.stats)
            click.echo(json_dumps(entry) if as_json else _format(entry))


def _served(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            eos_token_id: tuple[int, ...] | None, batch: int) -> Iterator[Request]:
    """Each prompt as a greedy request on the engine's step (`Runtime.submit`; its `batch`
    slots), yielded in input order once it ended. One slot: the next prompt is submitted once
    the one before was taken, so they run one after another and each record's runtime stats
    are those after its prompt; more: every prompt is queued at once (the engine runs `batch`
    at a time). Requests not yet yielded are cancelled if the caller stops."""
    waiting = iter(prompts)
    ahead = 1 if batch == 1 else len(prompts)
    pending: deque[Request] = deque()
    try:
        while True:
            for prompt in itertools.islice(waiting, ahead - len(pending)):
                pending.append(runtime.submit(prompt, max_new_tokens,
                                              eos_token_id=eos_token_id, wait=True))
            if not pending:
                return
            request = pending.popleft()
            request.result()
            yield request
    finally:
        for request in pending:
            request.cancel()


def _route_text(model: Path, text: dict, ids_text, ids_file, random_prompt, seed: int,
                max_new_tokens: int, eos_token_id, chunk_size, provider: str, capacity,
                no_padding: bool, specialize, static: bool, as_json: bool,
                speculative: str | None, progress: bool) -> None:
    """--prompt: the text path (cli/text_generate.py), on a dynamic decoder."""
    _refuse("--prompt", {"--ids": ids_text, "--ids-file": ids_file,
                         "--random-prompt": random_prompt, "--eos-token-id": eos_token_id,
                         "--static": static or None})
    if is_static_model(model):
        raise click.UsageError("--prompt runs dynamic decoders only; this is a static one")
    explicit_seed = click.get_current_context().get_parameter_source("seed")
    run_text_generate(
        model, text, max_new_tokens=max_new_tokens,
        seed=None if explicit_seed is click.core.ParameterSource.DEFAULT else seed,
        load_runtime=lambda path: load(path, provider=provider, capacity=capacity,
                                       chunk_size=chunk_size,
                                       padding=False if no_padding else None,
                                       specialize=specialize, speculative=speculative),
        as_json=as_json, progress=progress)


def _refuse(kind: str, options: Mapping[str, object]) -> None:
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot be used with {kind}")


def _prompts(vocab_size: int, ids_text: str | None, ids_file: Path | None,
             random_prompt: int | None, seed: int) -> list[list[int]]:
    if ids_text is not None:
        return [parse_ids(ids_text)]
    if ids_file is not None:
        return read_ids_file(ids_file)
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, random_prompt).tolist()]
