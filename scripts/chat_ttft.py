"""Turn-two time to first token of a chat: the KV cache kept, or the whole conversation re-fed.

A conversation (a system message, a first user turn and the model's reply) runs on the batch
engine, whose prefix reuse keeps it in a slot; turn two then prefills only its own tokens
(`onnx_chunk.text.conversation`). The comparison runs the same conversation on a second
runtime loaded with prefix_reuse=False, which feeds the whole rendered conversation again for
turn two. Each repeat starts a new conversation on the same warm runtimes; the medians are
printed with their ratio.

Without MODEL the script builds a reference decoder (random weights) and trains the test
suite's byte-level BPE tokenizer beside it (run it from the repository root).

    .venv/bin/python scripts/chat_ttft.py [MODEL] [--preset small] [--repeats 9]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx_chunk  # noqa: E402
from onnx_chunk.graph.model_folder import locate_model  # noqa: E402
from onnx_chunk.sampling import GREEDY  # noqa: E402
from onnx_chunk.text.conversation import Conversation  # noqa: E402

SYSTEM = " ".join(["You answer questions about long documents. Quote the document when it "
                   "helps, keep answers short, and say so when the document does not say."] * 6)
TURN_ONE = "Summarise the document: " + "the quick brown fox jumps over the lazy dog. " * 20
TURN_TWO = "And what does it say about the dog?"


def _reference_model(folder: Path, preset: str) -> Path:
    from onnx_chunk.models import build_decoder, config_for
    from tests.text.conftest import train_byte_level, write_tokenizer

    vocab = config_for(preset).vocab_size
    path = build_decoder(folder, preset=preset, variant="base")
    write_tokenizer(folder, train_byte_level(min(vocab, 1024)))
    return path


def _turn_two_ttft(runtime, reuse: bool, reply_tokens: int) -> tuple[float, int, int]:
    conversation = Conversation(runtime, system=SYSTEM, reuse_cache=reuse)
    "".join(conversation.say(TURN_ONE, reply_tokens, sampling=GREEDY))
    "".join(conversation.say(TURN_TWO, 1, sampling=GREEDY))
    turn, completion = conversation.last_turn, conversation.last_completion
    assert turn is not None and completion is not None and completion.stats is not None
    ttft = completion.stats.ttft_s
    assert ttft is not None  # the turn produced its token
    return ttft, len(turn.fed_ids), turn.reused_tokens


@click.command()
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--preset", default="small", show_default=True,
              help="Reference decoder to build when no MODEL is given.")
@click.option("--repeats", type=click.IntRange(min=1), default=9, show_default=True)
@click.option("--reply-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--provider", default="cpu", show_default=True)
@click.option("--chunk-size", type=click.IntRange(min=1), default=256, show_default=True)
def main(model: Path | None, preset: str, repeats: int, reply_tokens: int, provider: str,
         chunk_size: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = (locate_model(model).onnx_path if model is not None
                else _reference_model(Path(scratch), preset))
        runtime = onnx_chunk.load(path, provider=provider, capacity=2048, chunk_size=chunk_size)
        plain = onnx_chunk.load(path, provider=provider, capacity=2048, chunk_size=chunk_size,
                                prefix_reuse=False)
        _turn_two_ttft(runtime, True, reply_tokens)  # warm-up: sessions and arenas
        _turn_two_ttft(plain, False, reply_tokens)
        kept, refed = [], []
        for _ in range(repeats):
            seconds, fed_kept, reused = _turn_two_ttft(runtime, True, reply_tokens)
            kept.append(seconds)
            seconds, fed_all, _ = _turn_two_ttft(plain, False, reply_tokens)
            refed.append(seconds)
        kept_ms, refed_ms = statistics.median(kept) * 1e3, statistics.median(refed) * 1e3
        print(f"model {path} on {runtime.stats.provider}, chunk {runtime.stats.chunk_size}, "
              f"{repeats} repeats")
        print(f"turn 2, cache kept:   fed {fed_kept} tokens ({reused} held)  "
              f"median ttft {kept_ms:.2f} ms")
        print(f"turn 2, re-prefilled: fed {fed_all} tokens  median ttft {refed_ms:.2f} ms")
        print(f"ratio (re-prefilled / kept): {refed_ms / kept_ms:.1f}x")


if __name__ == "__main__":
    main()
