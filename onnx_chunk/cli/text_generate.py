"""`onnx-chunk generate MODEL --prompt TEXT`: text in, text streamed out (the body `generate`
routes to when --prompt is given), and the sampling options `generate` and `chat` share.

The text goes to stdout as it is produced; a summary line (finish reason, tokens, timings)
goes to stderr, so stdout holds the text alone. `--json` prints one object instead.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from onnx_chunk.cli.json_output import dumps as json_dumps
from onnx_chunk.cli.progress import prefill_progress
from onnx_chunk.sampling import Sampling, TokenLogprobs

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

# The sampling options: (flag, (type, help)).
_SAMPLING_OPTIONS = (
    ("--temperature", (float, "Sampling temperature (0: greedy).")),
    ("--top-k", (int, "Keep the k most likely tokens (0: all).")),
    ("--top-p", (float, "Keep the most likely tokens up to this mass.")),
    ("--min-p", (float, "Drop tokens below this fraction of the top one's probability.")),
    ("--repetition-penalty", (float, "Penalise the tokens already seen (1: off).")),
    ("--presence-penalty", (float, "Subtract from the logits of the tokens generated so far, "
                                   "in [-2, 2] (0: off).")),
    ("--frequency-penalty", (float, "Subtract once per time a token was generated, in "
                                    "[-2, 2] (0: off).")),
)
TEXT_ONLY = ("--prompt", "--chat", "--system", "--temperature", "--top-k", "--top-p",
             "--min-p", "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
             "--stop", "--ignore-eos", "--min-tokens", "--logprobs")


def sampling_options(command: Callable) -> Callable:
    """Add --temperature, --top-k, --top-p, --min-p, --repetition-penalty,
    --presence-penalty, --frequency-penalty and --stop."""
    command = click.option("--stop", multiple=True,
                           help="Stop before this text (repeatable).")(command)
    for name, (kind, text) in reversed(_SAMPLING_OPTIONS):
        command = click.option(name, type=kind, default=None,
                               help=f"{text} Default: genai_config.json's search.")(command)
    return command


def text_options(command: Callable) -> Callable:
    """`generate`'s text options: --prompt, --chat, --system, --ignore-eos, --min-tokens and
    the sampling options."""
    command = sampling_options(command)
    command = click.option("--logprobs", type=click.IntRange(min=0, max=20), default=None,
                           help="Give each token's log-probability and those of the N most "
                                "likely tokens at its position (in --json's 'logprobs'; else "
                                "one line a token on stderr).")(command)
    command = click.option("--min-tokens", type=click.IntRange(min=0), default=None,
                           help="No EOS before this many new tokens.")(command)
    command = click.option("--ignore-eos", is_flag=True,
                           help="Do not stop at the EOS token (only --max-new-tokens, the "
                                "capacity or --stop end the text).")(command)
    command = click.option("--system", default=None,
                           help="With --chat: a system message before the prompt.")(command)
    command = click.option("--chat", is_flag=True,
                           help="Send the prompt as a user message through the chat "
                                "template.")(command)
    return click.option("--prompt", default=None,
                        help="The prompt as text: text in, text streamed out.")(command)


def sampling_from(tokenizer: Tokenizer, options: dict[str, Any], seed: int | None) -> Sampling:
    """The Sampling of the command line: genai_config.json's search (`search_defaults`, as
    text generation and the server read it), overridden by the flags given (`seed` None keeps
    the config's random_seed)."""
    from onnx_chunk.text.generation import search_defaults

    overrides = {_key(name): options.get(_key(name)) for name, _ in _SAMPLING_OPTIONS}
    return Sampling.from_search(search_defaults(tokenizer), **overrides, seed=seed)


def given_text_options(options: dict[str, Any]) -> list[str]:
    """The text-only flags given (to refuse them on an ids request)."""
    return [name for name in TEXT_ONLY if options.get(_key(name)) not in (None, (), False)]


def run_text_generate(model: Path, options: dict[str, Any], *, max_new_tokens: int,
                      seed: int | None, load_runtime: Callable[[Path], Any],
                      as_json: bool, progress: bool = False) -> None:
    """Generate from the text prompt in `options` and print it (streamed, or one JSON line);
    `progress`: a bar of the prefill while a prompt longer than one chunk is fed."""
    from onnx_chunk.text.generation import stream_text
    from onnx_chunk.text.tokenizer import tokenizer_of

    if options.get("system") is not None and not options.get("chat"):
        raise click.UsageError("--system needs --chat (it is a message of the chat template)")
    runtime = load_runtime(model)
    tokenizer = tokenizer_of(runtime)
    prompt: Any = options["prompt"]
    if options.get("chat"):
        prompt = ([] if options.get("system") is None
                  else [{"role": "system", "content": options["system"]}])
        prompt.append({"role": "user", "content": options["prompt"]})
    sampling = sampling_from(tokenizer, options, seed)
    generation = stream_text(runtime, prompt, max_new_tokens, sampling=sampling,
                             stop=options.get("stop") or None,
                             ignore_eos=bool(options.get("ignore_eos")),
                             min_tokens=options.get("min_tokens") or 0,
                             logprobs=options.get("logprobs"))
    pieces = iter(generation)
    long_prompt = generation.prompt_tokens > runtime.stats.chunk_size
    with prefill_progress(_prefill_rows(runtime), generation.prompt_tokens,
                          progress and long_prompt):
        first = next(pieces, None)
    for piece in itertools.chain(() if first is None else (first,), pieces):
        if not as_json:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    completion = generation.completion
    assert completion is not None  # set once the iteration ended
    stats = completion.stats
    entry: dict[str, Any] = {
        "text": completion.text, "tokens": list(completion.tokens),
        "finish_reason": completion.finish_reason, "prompt_tokens": completion.prompt_tokens,
        "ttft_s": None if stats is None else stats.ttft_s,
        "decode_tokens_per_s": None if stats is None else stats.decode_tokens_per_s,
        "sampling": _sampling_record(sampling)}
    records = [_logprobs_record(tokenizer, logprobs) for logprobs in completion.logprobs]
    if options.get("logprobs") is not None:
        entry["logprobs"] = records
    if as_json:
        click.echo(json_dumps(entry, ensure_ascii=False))
        return
    click.echo()
    for record in records:
        tops = " ".join(f"{text!r}={_shown(logprob)}" for _, text, logprob in record["top"])
        click.echo(f"{record['text']!r}\t{_shown(record['logprob'])}\t{tops}", err=True)
    speed = entry["decode_tokens_per_s"]
    click.echo(f"[{completion.finish_reason}: {len(completion.tokens)} tokens after a "
               f"{completion.prompt_tokens}-token prompt | ttft {milliseconds(entry['ttft_s'])} | "
               f"decode {'-' if speed is None else f'{speed:.1f}'} tok/s]", err=True)


def _prefill_rows(runtime: Any) -> Callable[[], int]:
    """The prompt rows the engine prefilled since now (its own counter)."""

    def rows() -> int:
        engine = runtime.stats.engine
        return 0 if engine is None else engine.prefill_rows

    start = rows()
    return lambda: rows() - start


def _logprobs_record(tokenizer: Any, logprobs: TokenLogprobs) -> dict[str, Any]:
    """One token's logprobs as --json prints them: id, text, logprob, top [id, text, logprob];
    a log-probability of -inf (a token the sampling cut) is null."""
    def number(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return {"token": logprobs.token, "text": tokenizer.decode([logprobs.token]),
            "logprob": number(logprobs.logprob),
            "top": [[token, tokenizer.decode([token]), number(value)]
                    for token, value in logprobs.top]}


def milliseconds(seconds: float | None) -> str:
    """A duration for the terminal: milliseconds, or "-" when it was not measured."""
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _shown(logprob: float | None) -> str:
    return "-inf" if logprob is None else f"{logprob:.4f}"


def _sampling_record(sampling: Sampling) -> dict[str, Any]:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty, "seed": sampling.seed}


def _key(option: str) -> str:
    """The parameter name click gives an option: --top-k -> top_k."""
    return option.lstrip("-").replace("-", "_")

