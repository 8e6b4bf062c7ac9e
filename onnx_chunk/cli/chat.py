"""`onnx-chunk chat MODEL`: an interactive multi-turn chat in the terminal.

Each turn runs on the batch engine, whose prefix reuse keeps the conversation in a slot's KV
cache, so each turn prefills only its own tokens (onnx_chunk.text.conversation). Lines come
from stdin (typed, or piped: then each is echoed after the prompt marker so the transcript
reads as a dialogue); `/reset` starts a new
conversation, `/exit` or the end of input quits. The reply streams to stdout; a line of
statistics per turn goes to stderr. A turn the model cannot take (the conversation outgrew
the capacity, the template refused a message) prints one `error:` line and the chat goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from onnx_chunk.cli.text_generate import milliseconds, sampling_from, sampling_options
from onnx_chunk.errors import InputError
from onnx_chunk.runtime import PROVIDER_CHOICES, load
from onnx_chunk.text.conversation import Conversation
from onnx_chunk.text.tokenizer import tokenizer_of

USER_MARK = "> "
RESET, EXIT = "/reset", "/exit"


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="The longest reply, in tokens.")
@sampling_options
@click.option("--seed", type=int, default=None,
              help="Seed of sampling (default: genai_config.json's random_seed).")
@click.option("--no-cache-reuse", is_flag=True,
              help="Feed the whole conversation every turn (for comparison): the engine's "
                   "prefix reuse off, the rendering encoded again each turn.")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True)
@click.option("--capacity", type=click.IntRange(min=2), default=None,
              help="KV capacity in positions: the longest conversation (default: the model's "
                   "maximum).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Prefill chunk width (default: the model's declaration).")
def chat(model: Path, system: str | None, max_new_tokens: int, seed: int | None,
         no_cache_reuse: bool, provider: str, capacity: int | None, chunk_size: int | None,
         **options: object) -> None:
    """Chat with MODEL in the terminal, the conversation kept in the KV cache."""
    runtime = load(model, provider=provider, capacity=capacity,
                   chunk_size=chunk_size, prefix_reuse=not no_cache_reuse)
    tokenizer = tokenizer_of(runtime)
    if tokenizer.chat_template is None:
        raise InputError(f"the model folder {str(tokenizer.folder)!r} has no chat template; "
                         "use `onnx-chunk generate --prompt` for plain text")
    sampling = sampling_from(tokenizer, options, seed)
    given = options.get("stop")  # click's multiple=True: a tuple of strings
    stop = tuple(str(text) for text in given) if isinstance(given, tuple) and given else None
    interactive = sys.stdin.isatty()
    conversation = Conversation(runtime, system=system, reuse_cache=not no_cache_reuse)
    turn = 0
    while True:
        click.echo(USER_MARK, nl=False)
        line = sys.stdin.readline()
        if not line:
            click.echo()
            return
        text = line.rstrip("\n")
        if not interactive:
            click.echo(text)
        if text.strip() == EXIT:
            return
        if text.strip() == RESET:
            conversation = Conversation(runtime, system=system, reuse_cache=not no_cache_reuse)
            turn = 0
            click.echo("(new conversation)", err=True)
            continue
        if not text.strip():
            continue
        try:
            reply = conversation.say(text, max_new_tokens, sampling=sampling, stop=stop)
        except InputError as error:
            click.echo(f"error: {error}", err=True)
            continue
        turn += 1
        for piece in reply:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        _report(turn, conversation)


def _report(turn: int, conversation: Conversation) -> None:
    stats = conversation.last_turn
    completion = conversation.last_completion
    assert stats is not None and completion is not None  # set once the reply was read
    ttft = None if completion.stats is None else completion.stats.ttft_s
    click.echo(f"[turn {turn}: fed {len(stats.fed_ids)} tokens, {stats.reused_tokens} held in "
               f"the cache ({stats.how}) | ttft {milliseconds(ttft)} | "
               f"{len(completion.tokens)} tokens, {completion.finish_reason}]", err=True)
