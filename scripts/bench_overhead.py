"""Table 3: onnx-chunk's decode time per token against the bare ONNX Runtime forward.

End to end: `Sequence.generate` (a fresh sequence per round), decode time / decode steps, which
covers binding, the forward, the logits read and the token choice. Bare: a fresh sequence given
the same prompt (`generate(prompt, 1)`: the prompt's KV and its first token), then the same
decode session from the runtime's variant cache (`runtime.debug`) with the sequence's own KV
buffers bound to an IOBinding, the same attention-mask widths, and only
`session.run_with_iobinding` timed: a probe of the forward itself, which binds its own inputs.
Target: end to end / bare under 1.05. Rounds interleave the two; a pyinstrument profile of the
decode loop says where the rest of the time goes.

    .venv/bin/python scripts/bench_overhead.py [--variant int4]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import numpy as np
from _bench import environment as env
from _bench.child import write_json, write_text
from _bench.harness import (
    CHUNK_SIZE,
    NEW_TOKENS,
    format_value,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)

import onnx_chunk.runtime as rt

PROMPT_TOKENS = 40
TARGET = 1.05
PROFILE_TOP = 10
PROFILE_STEPS_PER_TOKEN = 8
PROFILE_SECONDS = 1.0


def _end_to_end(runtime: rt.Runtime, prompt: list[int], new_tokens: int) -> float:
    sequence = runtime.open_sequence()
    sequence.generate(prompt, new_tokens)
    generation = sequence.stats.last_generation
    assert generation is not None  # set by generate()
    return generation.decode_s / (generation.new_tokens - 1)


def _bare(runtime: rt.Runtime, prompt: list[int], new_tokens: int) -> float:
    sequence = runtime.open_sequence()
    first = sequence.generate(prompt, 1)[0]
    past = sequence.length
    vocab = runtime.stats.vocab_size
    logits = np.zeros((1, 1, vocab), dtype=np.float32)
    token = np.array([[first]], dtype=np.int64)
    masks = []
    for step in range(new_tokens - 1):
        width = past + step + 1
        if runtime.stats.mask_policy == "capacity":
            mask = np.zeros((1, runtime.stats.capacity), dtype=np.int64)
            mask[0, :width] = 1
        else:
            mask = np.ones((1, width), dtype=np.int64)
        masks.append(mask)
    elapsed = 0.0
    with runtime.debug.cache.acquire(runtime.debug.options.decode_key) as session:
        io = session.io_binding()
        sequence.buffers.bind_kv(io)
        io.bind_input("input_ids", "cpu", 0, np.int64, list(token.shape), token.ctypes.data)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        for mask in masks:
            io.bind_input("attention_mask", "cpu", 0, np.int64, list(mask.shape),
                          mask.ctypes.data)
            began = time.perf_counter()
            session.run_with_iobinding(io)
            elapsed += time.perf_counter() - began
    return elapsed / len(masks)


def _profile(runtime: rt.Runtime, prompt: list[int], new_tokens: int) -> dict:
    """Profile decode loops (prefills excluded) until PROFILE_SECONDS of them are sampled."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0002)
    sampled = 0.0
    while sampled < PROFILE_SECONDS:
        sequence = runtime.open_sequence()
        stream = sequence.stream(prompt, new_tokens)
        next(stream)
        began = time.perf_counter()
        profiler.start()
        for _ in stream:
            pass
        profiler.stop()
        sampled += time.perf_counter() - began
    session = profiler.last_session
    root = None if session is None else session.root_frame()
    if root is None:
        raise SystemExit("error: the profiler recorded no frame (a decode shorter than its "
                         "sampling interval)")
    own: dict[str, float] = defaultdict(float)

    def walk(frame) -> None:
        children = [child for child in frame.children if not child.is_synthetic_leaf]
        name = frame.function.rsplit(".", 1)[-1]
        where = "native" if frame.file_path_short == "<built-in>" else (
            f"{frame.file_path_short}:{frame.line_no}")
        own[f"{name} ({where})"] += frame.time - sum(child.time for child in children)
        for child in children:
            walk(child)

    walk(root)
    total = root.time
    top = sorted(((name, seconds) for name, seconds in own.items() if seconds > 0),
                 key=lambda item: -item[1])[:PROFILE_TOP]
    return {"total_s": total, "top": [[name, seconds, seconds / total] for name, seconds in top]}


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", default=None,
                        help="reference decoder presets to measure (default bench and tiny)")
    args = parser.parse_args(argv)
    repetitions, new_tokens = (2, 8) if args.quick else (args.repetitions, NEW_TOKENS)
    if args.model is not None and args.preset:
        parser.error("--model and --preset name the model twice; pass one of them")
    models = ({env.named_export(args.model)[0]: env.source_model(args, "bench")} if args.model
              else {preset: env.build_model(args.out, preset, args.variant)
                    for preset in args.preset or ["bench", "tiny"]})
    rows, results = [], {}
    profiles = []
    for preset, model in models.items():
        config = env.model_config(model)
        prompt = seeded_prompt(PROMPT_TOKENS, config["vocab_size"])
        runtime = rt.load(model, provider="cpu", chunk_size=CHUNK_SIZE)
        _end_to_end(runtime, prompt, new_tokens)  # creates the variants both sides use
        measured: dict[str, list[float]] = {"end-to-end": [], "bare": []}
        for round_index in range(repetitions):
            for side in round_order(tuple(measured), round_index):
                run = _end_to_end if side == "end-to-end" else _bare
                measured[side].append(run(runtime, prompt, new_tokens))
        e2e, bare = summarize(measured["end-to-end"]), summarize(measured["bare"])
        value = ratio(e2e, bare)
        rows.append([preset, format_value(summarize(v * 1e3 for v in measured["end-to-end"]), 3),
                     format_value(summarize(v * 1e3 for v in measured["bare"]), 3),
                     f"{1e3 * (e2e.median - bare.median):.3f}",
                     f"{value:.3f}x {verdict(value, TARGET, False)}"])
        profile = _profile(runtime, prompt, PROFILE_STEPS_PER_TOKEN * new_tokens)
        results[preset] = {"runs": measured, "profile": profile}
        profiles.append(f"{preset} ({args.variant}), decode loop, "
                        f"{profile['total_s'] * 1e3:.0f} ms sampled:\n\n" + markdown_table(
                            ["function (own time)", "ms", "share"],
                            [[name, f"{seconds * 1e3:.1f}", f"{100 * share:.1f}%"]
                             for name, seconds, share in profile["top"]]))
    table = markdown_table(["model", "end-to-end ms/token", "bare run_with_iobinding ms",
                            "overhead ms", "ratio (target < 1.05)"], rows)
    text = table + "\n\n" + "\n\n".join(profiles) + "\n"
    name = f"overhead_{args.variant}{'_quick' if args.quick else ''}"
    write_json(args.out / f"{name}.json", {"variant": args.variant, "repetitions": repetitions,
                                          "new_tokens": new_tokens,
                                          "prompt_tokens": PROMPT_TOKENS, "models": results})
    write_text(args.out / f"{name}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
