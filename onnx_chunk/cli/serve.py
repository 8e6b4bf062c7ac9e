"""`onnx-chunk serve MODEL`: the OpenAI-compatible server (onnx_chunk.serve) under uvicorn.

The listening socket is bound before the model loads, so a busy port is one error line; the
line `listening on http://HOST:PORT` (stderr) gives the port actually bound (`--port 0` picks a
free one). SIGTERM or SIGINT drains: no new request is admitted, running streams end with an
error event, and the command exits 0 once every connection has closed. A model folder that
would fail every request (a chat template that does not compile, a bad `search` section) is
one error line at start.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import click

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import PROVIDER_CHOICES
from onnx_chunk.runtime.engine.speculation import SPECULATIVE_CHOICES

# --cache (a development option): how the variant cache keys prefill widths.
# auto: the provider's default; ladder: a variant per ladder tier, remainders padded up;
# exact: a variant per distinct width, padding off (the per-shape cache that thrashes).
_CACHE_MODES: dict[str, dict[str, Any]] = {
    "auto": {}, "ladder": {"specialize": True, "padding": True},
    "exact": {"specialize": "exact", "padding": False}}


@click.command(help="Serve MODEL over an OpenAI-compatible HTTP API "
                    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="The port to bind (0: a free one, printed at start).")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences the batch engine serves at once.")
@click.option("--queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests that may wait for a slot; beyond them the answer is 429.")
@click.option("--api-key", "api_keys", multiple=True, envvar="ONNX_CHUNK_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* and /tokenize; may be given "
                   "several times, one per tenant (env ONNX_CHUNK_API_KEY: keys separated by "
                   "spaces). A key's requests reuse only prefixes of the same key.")
@click.option("--share-prefixes", is_flag=True,
              help="Let the requests of different API keys reuse each other's prompt prefixes "
                   "(a shared cache tells one tenant, by its speed and cached_tokens, what "
                   "another sent).")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True)
@click.option("--capacity", type=click.IntRange(min=2), default=None,
              help="The KV capacity (context) of each slot; default the model's.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=None,
              help="The largest request body read; larger ones are answered 413 "
                   "(default 8 MiB: a prompt filling a 128k-token context fits).")
@click.option("--max-answer-bytes", type=click.IntRange(min=1), default=None,
              help="The largest answer one request may make; past it the answer is a 400 "
                   "answer_too_large (default 32 MiB).")
@click.option("--parse-special-in-content", is_flag=True,
              help="Turn special tokens typed in messages into control tokens, as transformers' "
                   "apply_chat_template does (default: they are text, as in OpenAI's API, so a "
                   "user cannot forge a turn).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Render a request's own chat_template (in the same sandbox), as vLLM's flag "
                   "of that name does (default: refused with a 400; a template is code).")
@click.option("--no-prefix-reuse", "prefix_reuse", is_flag=True, flag_value=False, default=True,
              help="Start every request on an empty slot (default: a slot keeps its KV after "
                   "a request, and a later prompt starting with the same tokens prefills only "
                   "the rest).")
@click.option("--speculative", type=click.Choice(SPECULATIVE_CHOICES), default=None,
              help="Draft tokens by prompt lookup and verify them in one forward (greedy "
                   "output unchanged, sampled output exact in distribution).")
@click.option("--exact", is_flag=True,
              help="Exact mode: a request's numbers do not depend on how its rows were "
                   "grouped (chunks, batch neighbours, reused prefixes), bit for bit; "
                   "refuses --speculative (docs/row_grouping.md).")
@click.option("--cache", "cache_mode", type=click.Choice(sorted(_CACHE_MODES)), default="auto",
              hidden=True, help="Development: the variant cache's keying (exact: per shape).")
def serve(model: Path, host: str, port: int, batch: int, queue: int,
          api_keys: tuple[str, ...], share_prefixes: bool, provider: str,
          capacity: int | None, max_body_bytes: int | None, max_answer_bytes: int | None,
          parse_special_in_content: bool, trust_request_chat_template: bool,
          prefix_reuse: bool, speculative: str | None,
          exact: bool, cache_mode: str) -> None:
    try:
        from onnx_chunk.serve import create_app
        from onnx_chunk.serve.app import DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_BODY_BYTES
        from onnx_chunk.serve.server import DrainingServer, bind
    except ModuleNotFoundError as error:
        raise ConfigError(f"onnx-chunk serve needs the serve extra ({error.name} is not "
                          "installed): pip install 'onnx-chunk[serve]'") from error
    from onnx_chunk.runtime import load

    if any(not key.strip() for key in api_keys):
        raise ConfigError("--api-key must not be empty; give a key or leave the option out")
    try:
        listener = bind(host, port)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}; pick "
                          "another --host or --port (0: a free one)") from error
    with contextlib.closing(listener), load(model, provider=provider, capacity=capacity,
                                            max_batch=batch, max_queue=queue,
                                            prefix_reuse=prefix_reuse,
                                            speculative=speculative, exact=exact,
                                            **_CACHE_MODES[cache_mode]) as runtime:
        app = create_app(
            runtime, api_key=list(api_keys), share_prefixes=share_prefixes,
            parse_special_in_content=parse_special_in_content,
            trust_request_chat_template=trust_request_chat_template,
            max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
            max_answer_bytes=(DEFAULT_MAX_ANSWER_BYTES if max_answer_bytes is None
                              else max_answer_bytes))
        server = DrainingServer(app, log_level=logging.getLogger().level)
        bound_host, bound_port = listener.getsockname()[:2]
        click.echo(f"listening on http://{bound_host}:{bound_port} ({runtime.stats.provider}, "
                   f"batch {batch}, capacity {runtime.stats.capacity}, prefix reuse "
                   f"{'on' if prefix_reuse else 'off'}{', exact' if exact else ''})",
                   err=True)
        server.run(sockets=[listener])
    click.echo("stopped", err=True)
