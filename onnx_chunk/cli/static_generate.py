"""`onnx-chunk generate` on a static (fixed-shape) decoder: the body `generate` calls when the
model is static or `--static` is given.

The chunk graph's rows c and capacity C are fixed; `--chunk-size` and `--kv-capacity` only
state what the caller expects and must match them. `--max-input-len` is L. What the fixed
shapes cost (truncated tokens, positions dropped off the rolling cache) is printed with every
prompt, and `--strict` refuses such requests instead. `generate` opens the runner with
`onnx_chunk.static.load_static` (which checks those options against the graph)
and hands it to `run_static_generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onnx_chunk import arguments
from onnx_chunk.cli.json_output import dumps as json_dumps
from onnx_chunk.static import StaticGenerationResult, StaticRunner


def static_record(index: int, prompt: Sequence[int], result: StaticGenerationResult) -> dict:
    """The JSON object printed for one prompt."""
    return {
        "prompt": index,
        "prompt_tokens": len(prompt),
        "tokens": result.tokens,
        "truncated_tokens": result.truncated_tokens,
        "dropped_positions": result.dropped_positions,
        "warnings": result.warnings,
        "ttft_s": result.ttft_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "aligned_len": result.aligned_len,
        "pad_count": result.pad_count,
        "chunks": result.chunks,
        "finish_reason": result.finish_reason,
    }


def _format(entry: dict) -> str:
    speed = entry["decode_tokens_per_s"]
    lines = [f"prompt {entry['prompt']} ({entry['prompt_tokens']} tokens): "
             f"{' '.join(map(str, entry['tokens']))}",
             f"  aligned {entry['aligned_len']} (pad {entry['pad_count']}, truncated "
             f"{entry['truncated_tokens']}) | chunks {entry['chunks']} | ttft "
             f"{entry['ttft_s'] * 1000:.1f} ms | decode "
             f"{'-' if speed is None else f'{speed:.1f}'} tok/s | dropped "
             f"{entry['dropped_positions']} | finish {entry['finish_reason']}"]
    lines += [f"  warning: {warning}" for warning in entry["warnings"]]
    return "\n".join(lines)


def run_static_generate(
    runner: StaticRunner,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    as_json: bool = False,
    echo: Callable[[str], None],
) -> list[StaticGenerationResult]:
    """Generate greedily for each prompt in order, each ending at an id of `eos_token_id`
    (one or several) or after `max_new_tokens`, and `echo` one line (JSON) or block (text)
    per prompt, after a header line in text mode; returns the results. The end ids and every
    prompt are checked before any runs, so a bad prompt N fails before N - 1 were served."""
    stop = arguments.stop_ids(eos_token_id, (), runner.vocab_size)
    aligned = [runner.align(prompt, max_new_tokens) for prompt in prompts]
    if not as_json:
        limits, spec = runner.limits, runner.chunk_spec
        echo(f"static decoder: provider {runner.device.label}, L={limits.max_input_len}, "
             f"c={limits.chunk_size}, C={limits.capacity} (decode room {limits.decode_room}), "
             f"{spec.num_layers} layers, {runner.kv_dtype} KV cache "
             f"({runner.kv_bytes / 2 ** 20:.2f} MiB){', strict' if runner.strict else ''}")
    results = []
    for index, (prompt, request) in enumerate(zip(prompts, aligned)):
        result = runner.decode(runner.run_prefill(request), max_new_tokens,
                               eos_token_id=stop)
        entry = static_record(index, prompt, result)
        echo(json_dumps(entry) if as_json else _format(entry))
        results.append(result)
    return results
