"""Prompt-lookup speculative decoding against plain decoding: three measurements.

1. random: seeded random prompts on a real-size export (default qwen05-int4, from
   scripts/make_bench_models.py's cache; `--model` for another), greedy, EOS off: decode
   tokens/s of `load(..., speculative="prompt-lookup")` against plain decoding, the two
   runtimes loaded side by side in one process and run alternately (the order rotates per
   round). Goal >= 0.97x: text the drafts cannot predict must not get slower.
2. verify-cost: one forward of k + 1 rows with every row's logits (a verification) against
   one decode step, at the same past length, on the same model; k = 1, 2, 4, 8 (goal <= 1.5x
   for k = 4: what a real model's acceptance rate can buy is bounded by it). The forwards
   alternate one by one and each verification is divided by its own cycle's decode step.
3. hits: a workload where drafts hit: a decoder whose greedy output repeats itself (default
   the `tiny` reference decoder, as random small decoders do, with the same seeded prompts) or
   `--hit-model copy-fp32` (scripts/make_bench_models.py's decoder trained to continue periodic
   sequences) with periodic prompts: a seeded block of P distinct ids repeated 1.5 to 2 times,
   for several P, whose greedy continuation is the period, which prompt lookup drafts. Decode
   tokens/s against plain and the acceptance rate, accepted/drafted (goal >= 2x).
   `--hit-prompts` overrides the choice (periodic for a `copy-*` model, random otherwise).
   `--hit-sampling temperature=2,top_k=100` samples both systems with those `Sampling` fields
   instead of greedily: a draft is then kept with the probability the processed distribution
   gives it (the rejection rule), so the fields set the share kept: the workload where about
   half the drafts hit (goal >= 1.3x there). Sampled tokens differ between the systems by
   design; each system's share of tokens that repeat what followed their previous token last
   time (`copied_tokens`) is compared instead, a statistic of the output's distribution.
4. engine-verify: how the batch engine should verify the drafts of B rows, on plain ONNX
   Runtime with the real-size export (one CPU session, memory patterns off, past KV of
   `past` positions): B forwards of [1, k + 1] (what the engine does: each drafted row on its
   own slot) against one [B, k + 1] forward (the batched alternative), with one [B, 1] decode
   forward as the unit; B = 4, k = 2.

A benchmark model name (`--model`, `--hit-model`: qwen05-int4, copyq05-int4) is measured as
users serve it, converted by `onnx-chunk convert` with its defaults (a CPU export's layers as
int8 matmuls) into --out/models, once; an export folder runs as given (a raw INT4 export then
runs its 4-bit weights).

Every ratio is the median over rounds with its spread (lowest-highest), and the tokens of both
systems are compared (greedy output must be identical). The load average is printed before and
after; on a loaded machine (load above ~2.5 on 2 cores) the numbers are not conclusions.

    .venv/bin/python scripts/bench_speculative.py [--quick] [--repetitions 5]
        [--model NAME|FOLDER] [--hit-model NAME|FOLDER] [--hit-prompts random|periodic]
        [--hit-periods P,P,...] [--hit-sampling FIELD=VALUE,...]
        [--part random|verify-cost|hits ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from _bench import environment as env
from _bench.child import publish
from _bench.copy_decoder import FIRST_ID as PERIODIC_FIRST_ID
from _bench.copy_decoder import VOCAB_SIZE as PERIODIC_END_ID
from _bench.harness import markdown_table, round_order, seeded_prompt, summarize
from _bench.models import BenchModelMissing

import onnx_chunk
from onnx_chunk.sampling import Sampling

PARTS = ("random", "verify-cost", "hits", "engine-verify")
# The prefill chunk width a benchmark model name is converted at (convert's default).
CHUNK_SIZE = 512
SPEC, PLAIN = "prompt-lookup", "plain"
FULL: dict[str, Any] = {
        "prompts": [128, 1000], "new_tokens": 128, "capacity": 2048, "ks": [1, 2, 4, 8],
        "past": 1000, "forwards": 10, "hit_prompts": [16, 64, 200], "hit_new_tokens": 256,
        "hit_periods": [8, 16, 32, 48],
        "engine": {"batch": 4, "k": 2, "past": 300}}
QUICK: dict[str, Any] = {
         "prompts": [16], "new_tokens": 16, "capacity": 256, "ks": [1, 4], "past": 32,
         "forwards": 3, "hit_prompts": [16], "hit_new_tokens": 32, "hit_periods": [12, 40],
         "engine": {"batch": 2, "k": 2, "past": 16}}


def main(argv: list[str] | None = None) -> int:
    parser = env.common_parser(__doc__.splitlines()[0], variant=False)
    parser.add_argument("--hit-model", default=None,
                        help="the decoder whose output repeats: a benchmark model name "
                             "(copy-fp32) or an export folder (default the tiny reference)")
    parser.add_argument("--hit-prompts", choices=("random", "periodic"), default=None,
                        help="the hits part's prompts (default periodic for a copy-* model, "
                             "random otherwise)")
    parser.add_argument("--hit-periods", default=None,
                        help="the periodic prompts' periods, comma-separated (default 8,16,32,48;"
                             " the copy decoders are trained on 8 to 48); implies periodic "
                             "prompts")
    parser.add_argument("--hit-sampling", default=None,
                        help="sample the hits part with these Sampling fields instead of "
                             "greedily, e.g. temperature=2,top_k=100")
    parser.add_argument("--part", action="append", choices=PARTS)
    args = parser.parse_args(argv)
    parts = tuple(part for part in PARTS if part in (args.part or PARTS))
    given = [flag for flag, value in (("--hit-model", args.hit_model),
                                      ("--hit-prompts", args.hit_prompts),
                                      ("--hit-periods", args.hit_periods),
                                      ("--hit-sampling", args.hit_sampling))
             if value is not None]
    if given and "hits" not in parts:
        parser.error(f"{', '.join(given)} applies to --part hits, which this run leaves out")
    if args.hit_periods is not None and args.hit_prompts == "random":
        parser.error("--hit-periods sets periodic prompts; --hit-prompts random has none")
    sampling = None if args.hit_sampling is None else hit_sampling(parser, args.hit_sampling)
    plan = QUICK if args.quick else FULL
    if args.hit_periods is not None:
        plan = dict(plan, hit_periods=_periods(parser, args.hit_periods))
    rounds = 1 if args.quick else args.repetitions
    model, note = _real_size(args)
    print(f"load average before: {os.getloadavg()}; model {model} {note}", file=sys.stderr)
    sections = [f"model: {model} {note}; load average before {_load()}"]
    data: dict = {"plan": plan, "rounds": rounds, "model": str(model), "note": note,
                  "load_before": os.getloadavg()}
    if "random" in parts:
        data["random"] = _decode_ratio(model, partial(random_prompts, plan["prompts"]),
                                       plan["new_tokens"], plan, rounds)
        sections.append("### random prompts\n\n" + _ratio_table(data["random"], 0.97))
    if "verify-cost" in parts:
        data["verify_cost"] = _verify_cost(model, plan, rounds)
        sections.append("### verification cost\n\n" + _cost_table(data["verify_cost"]))
    if "hits" in parts:
        if args.hit_model is None:
            hit_name, hit_model = "tiny", env.build_model(args.out, "tiny").parent
        else:
            hit_name, hit_model = model_to_measure(args.hit_model, args.out)
        kind = args.hit_prompts or ("periodic" if hit_name.startswith("copy")
                                    or args.hit_periods is not None else "random")
        data["hits"] = _decode_ratio(hit_model, partial(hit_prompts, kind, plan),
                                     plan["hit_new_tokens"], plan, rounds,
                                     periodic=kind == "periodic",
                                     sampling=sampling)
        data["hits"]["prompts"] = kind
        sampled = "" if sampling is None else f", sampled: {args.hit_sampling}"
        sections.append(f"### drafts that hit ({hit_model}, {kind} prompts{sampled})\n\n"
                        + _ratio_table(data["hits"],
                                       2.0 if sampling is None else 1.3))
    if "engine-verify" in parts:
        data["engine_verify"] = _engine_verify(model, plan["engine"], rounds * 3)
        sections.append("### verifying several rows' drafts\n\n"
                        + _engine_table(data["engine_verify"]))
    data["load_after"] = os.getloadavg()
    sections.append(f"load average after {_load()}")
    publish(args.out, "speculative" + ("_quick" if args.quick else ""), data,
            "\n\n".join(sections))
    return 0


def model_to_measure(value: str, out: Path) -> tuple[str, Path]:
    """(name, folder) of the model `value` names as a user serves it: a benchmark model name
    (qwen05-int4) converted with `onnx-chunk convert`'s defaults (int8 matmuls on a CPU export)
    into `out`/models, once; an export folder exactly as given (converted or not)."""
    name, folder = env.named_export(value)
    return name, _measured_folder(value, name, folder, out)


def _measured_folder(value: str, name: str, folder: Path, out: Path) -> Path:
    if (Path(value) / "genai_config.json").is_file():
        return folder
    return env.converted_export(out, name, folder, CHUNK_SIZE).parent


def _real_size(args) -> tuple[Path, str]:
    """--model (a bench-model name, converted, or an export folder), else qwen05-int4 converted
    when it is built, else the `bench` reference decoder."""
    if args.model is not None:
        return model_to_measure(args.model, args.out)[1], ""
    try:
        name, folder = env.export_folder("qwen05-int4")
    except BenchModelMissing:
        pass
    else:
        return (_measured_folder(name, name, folder, args.out),
                "(Qwen2.5-0.5B shape, random weights, converted with convert's defaults)")
    return (env.build_model(args.out, "bench").parent,
            "(qwen05-int4 absent: the `bench` reference decoder instead)")


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _periods(parser, given: str) -> list[int]:
    """--hit-periods as a list; a parser error (exit 2) for one the ids cannot fill."""
    most = PERIODIC_END_ID - PERIODIC_FIRST_ID
    try:
        periods = [int(part) for part in given.split(",")]
    except ValueError:
        parser.error(f"--hit-periods: {given!r} is not comma-separated integers")
    if not periods or any(not 2 <= period <= most for period in periods):
        parser.error(f"--hit-periods: each period must be 2 to {most} (the distinct ids the "
                     f"copy decoders are trained on), got {given!r}")
    return periods


def periodic_prompt(period: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A block of `period` distinct ids (seeded by (seed, period)) repeated to a seeded length
    between 1.5 and 2 periods: its continuation is the period. The ids are those the copy
    decoders are trained on (past the fixture tokenizer's special tokens, below
    copy_decoder.VOCAB_SIZE: copyq05's vocabulary is wider, its added ids untrained)."""
    rng = np.random.default_rng([seed, period])
    block = rng.choice(np.arange(PERIODIC_FIRST_ID, min(vocab_size, PERIODIC_END_ID)), period,
                       replace=False)
    length = int(rng.integers(period * 3 // 2, period * 2 + 1))
    return [int(block[index % period]) for index in range(length)]


def hit_prompts(kind: str, plan: dict, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(label, prompt) of the hits part: periodic prompts for each of the plan's periods, or the
    seeded random prompts of its lengths."""
    if kind == "periodic":
        ids = min(vocab_size, PERIODIC_END_ID) - PERIODIC_FIRST_ID
        for period in plan["hit_periods"]:
            positions = 2 * period + plan["hit_new_tokens"]
            if period > ids or positions > plan["capacity"]:
                print(f"error: --hit-periods: period {period} takes {period} distinct ids (the "
                      f"model has {ids}) and up to {positions} positions (capacity "
                      f"{plan['capacity']})", file=sys.stderr)
                raise SystemExit(2)
        prompts = [periodic_prompt(period, vocab_size) for period in plan["hit_periods"]]
        return [(f"{len(prompt)} (period {period})", prompt)
                for period, prompt in zip(plan["hit_periods"], prompts)]
    return random_prompts(plan["hit_prompts"], vocab_size)


def copied_tokens(prompt: list[int], tokens: list[int]) -> int:
    """How many of `tokens` (generated after `prompt`) repeat what followed the latest earlier
    occurrence of the token before them: a statistic of the output's distribution, the same
    for plain and speculative sampling where the rejection rule is exact."""
    history = list(prompt)
    copied = 0
    for token in tokens:
        earlier = next((index for index in range(len(history) - 2, -1, -1)
                        if history[index] == history[-1]), None) if history else None
        copied += earlier is not None and history[earlier + 1] == token
        history.append(token)
    return copied


def hit_sampling(parser: argparse.ArgumentParser, given: str) -> dict:
    """--hit-sampling's `Sampling` fields ("temperature=2,top_k=100" -> {"temperature": 2.0,
    "top_k": 100}), each parsed as its field's number type; a parser error (exit 2) for a
    field Sampling lacks, one that is not a plain number (int or float), a seed (each round
    and prompt has its own), or a value Sampling refuses."""
    numbers = {"int": int, "float": float}
    kinds = {item.name: numbers.get(str(item.type)) for item in dataclasses.fields(Sampling)}
    fields: dict = {}
    for item in given.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        kind = kinds.get(name)
        if kind is None or name == "seed":
            parser.error(f"--hit-sampling: {name!r} is not a numeric Sampling field it takes")
        try:
            fields[name] = kind(value)
        except ValueError:
            parser.error(f"--hit-sampling: {item!r} is not {name}={kind.__name__.upper()}")
    try:
        Sampling(**fields)
    except (TypeError, ValueError) as error:
        parser.error(f"--hit-sampling: {error}")
    return fields


def random_prompts(lengths: list[int], vocab_size: int) -> list[tuple[str, list[int]]]:
    """(label, prompt) of the seeded random prompts of `lengths`."""
    return [(str(length), seeded_prompt(length, vocab_size)) for length in lengths]


def _period(prompt: list[int]) -> int:
    """The smallest p with prompt[i] == prompt[i - p] for every i >= p."""
    return next(p for p in range(1, len(prompt) + 1)
                if all(prompt[i] == prompt[i - p] for i in range(p, len(prompt))))


def _decode_ratio(model: Path, make_prompts: Callable[[int], list[tuple[str, list[int]]]],
                  new_tokens: int, plan: dict, rounds: int,
                  periodic: bool = False, sampling: dict | None = None) -> dict:
    """Decode tokens/s of both systems per prompt and round, alternating; tokens compared.

    `make_prompts(vocab_size)`: the (label, prompt) pairs, a label naming its prompt in the
    results. `periodic` (periodic prompts): each system's share of tokens that continue the
    prompt's period is reported too (a decoder that repeats one token also has its drafts kept,
    without copying). `sampling`: `Sampling` fields both systems sample with, each (round,
    prompt) with one seed, instead of choosing greedily; the tokens are then not compared
    (`identical` None)."""
    runtimes = {system: onnx_chunk.load(model, provider="cpu", capacity=plan["capacity"],
                                        speculative=SPEC if system == SPEC else None)
                for system in (SPEC, PLAIN)}
    vocab = runtimes[PLAIN].stats.vocab_size
    prompts = make_prompts(vocab)
    speeds: dict[str, dict[str, list[float]]] = {SPEC: {}, PLAIN: {}}
    continuing = {SPEC: [0, 0], PLAIN: [0, 0]}  # system -> [tokens continuing, tokens]
    copying = {SPEC: [0, 0], PLAIN: [0, 0]}  # system -> [tokens copied, tokens]
    kept: dict[str, list[int]] = {}  # label -> [accepted, drafted]
    identical = True
    for round_index in range(rounds):
        for prompt_index, (label, prompt) in enumerate(prompts):
            tokens = {}
            chosen = (None if sampling is None else
                      Sampling(**sampling, seed=round_index * 1000 + prompt_index))
            for system in round_order((SPEC, PLAIN), round_index):
                with runtimes[system].open_sequence() as sequence:
                    tokens[system] = sequence.generate(prompt, new_tokens, [],
                                                       sampling=chosen)
                    generation = sequence.stats.last_generation
                    assert generation is not None and generation.decode_tokens_per_s is not None
                    speeds[system].setdefault(label, []).append(
                        generation.decode_tokens_per_s)
                    if system == SPEC:
                        counts = kept.setdefault(label, [0, 0])
                        counts[0] += sequence.stats.accepted_tokens
                        counts[1] += sequence.stats.draft_tokens
            identical &= tokens[SPEC] == tokens[PLAIN]
            for system, counts in copying.items():
                counts[0] += copied_tokens(prompt, tokens[system])
                counts[1] += len(tokens[system])
            if periodic:  # how much of each system's output continues the prompt's period
                period = _period(prompt)
                for system, counts in continuing.items():
                    expected = [prompt[(len(prompt) + index) % period]
                                for index in range(len(tokens[system]))]
                    counts[0] += sum(a == b for a, b in zip(tokens[system], expected))
                    counts[1] += len(expected)
            print(f"round {round_index + 1}/{rounds} prompt {label} ({len(prompt)} ids): "
                  f"{speeds[SPEC][label][-1]:.1f} against "
                  f"{speeds[PLAIN][label][-1]:.1f} tok/s", file=sys.stderr)
    for runtime in runtimes.values():
        runtime.close()
    return {"speeds": speeds, "accepted": sum(counts[0] for counts in kept.values()),
            "drafted": sum(counts[1] for counts in kept.values()), "kept": kept,
            "identical": identical if sampling is None else None,
            "tokens_equal": identical,
            "sampling": sampling, "new_tokens": new_tokens,
            "continues_period": {system: right / total if total else None
                                 for system, (right, total) in continuing.items()},
            "copied": {system: copied / total if total else None
                       for system, (copied, total) in copying.items()}}


def _verify_cost(model: Path, plan: dict, rounds: int) -> dict:
    """Seconds of a (k + 1)-row verification forward and of one decode step at `past`."""
    runtime = onnx_chunk.load(model, provider="cpu", capacity=plan["capacity"])
    vocab = runtime.stats.vocab_size
    times: dict[str, list[float]] = {}
    with runtime.open_sequence() as sequence:
        sequence.prefill(seeded_prompt(plan["past"], vocab))
        rng = np.random.default_rng(0)
        for system, rows in forward_schedule(plan, rounds):
            ids = rng.integers(3, vocab, rows)
            began = time.perf_counter()
            if rows == 1:
                sequence.decode(int(ids[0]))
            else:
                # One forward of `rows` rows with every row's logits: a verification.
                sequence.prefill(ids, all_logits=True)
            times.setdefault(system, []).append(time.perf_counter() - began)
            sequence.rewind(rows)
    runtime.close()
    return {"times": times, "bare": _bare_verify_cost(model, plan, rounds), "past": plan["past"]}


def _bare_verify_cost(model: Path, plan: dict, rounds: int) -> dict[str, list[float]]:
    """The same forwards on plain ONNX Runtime (the measured model's own graph, one CPU session,
    the past as zeros): whether the cost of k + 1 rows is ONNX Runtime's kernels' or the
    runtime's."""
    import onnxruntime as ort

    path = model / "model.onnx" if model.is_dir() else model
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    head = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"][
        "head_size"]
    feeds = {system: _feeds(session, 1, rows, plan["past"], head)
             for system, rows in forward_schedule(plan, 1)}
    for system_feeds in feeds.values():
        session.run(["logits"], system_feeds)
    times: dict[str, list[float]] = {}
    for system, _ in forward_schedule(plan, rounds):
        began = time.perf_counter()
        session.run(["logits"], feeds[system])
        times.setdefault(system, []).append(time.perf_counter() - began)
    return times


def forward_schedule(plan: dict, rounds: int) -> Iterator[tuple[str, int]]:
    """(system, rows) of every timed forward of the verify-cost part: `rounds` x
    `plan["forwards"]` cycles, each the decode step and every k + 1-row verification once, in
    an order that rotates cycle by cycle. A one-row step reads the weights and a verification
    computes more, so a host whose memory bandwidth drifts (neighbours) moves one and not the
    other: forward by forward, cycle i of every system meets the same moment (`_cost_table`
    takes each verification's ratio to its own cycle's decode step)."""
    systems = ["decode"] + [f"k={k}" for k in plan["ks"]]
    for cycle in range(rounds * plan["forwards"]):
        for system in round_order(systems, cycle):
            yield system, 1 if system == "decode" else int(system[2:]) + 1


def _engine_verify(model: Path, plan: dict, repetitions: int) -> dict:
    """Seconds of B [1, k + 1] forwards, one [B, k + 1] forward and one [B, 1] decode."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    path = model / "model.onnx" if model.is_dir() else model
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    batch, rows, past = plan["batch"], plan["k"] + 1, plan["past"]
    head = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"][
        "head_size"]
    forms = {"own forwards": (_feeds(session, 1, rows, past, head), batch),
             "one batched forward": (_feeds(session, batch, rows, past, head), 1),
             "decode": (_feeds(session, batch, 1, past, head), 1)}
    refused = None
    try:
        session.run(["logits"], forms["one batched forward"][0])
    except Exception as error:  # ORT's own types: the kernel refuses the batched form
        refused = str(error).splitlines()[0]
        del forms["one batched forward"]
    for feeds, _ in forms.values():
        session.run(["logits"], feeds)
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    for repetition in range(repetitions):
        for name in round_order(list(forms), repetition):
            feeds, times = forms[name]
            began = time.perf_counter()
            for _ in range(times):
                session.run(["logits"], feeds)
            seconds[name].append(time.perf_counter() - began)
    return {"plan": plan, "seconds": seconds, "batched_refused": refused}


def _feeds(session, batch: int, rows: int, past: int, head_size: int) -> dict:
    """Inputs of one forward of `rows` new tokens per row after `past` cached positions."""
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    feeds = {"input_ids": np.full((batch, rows), 3, np.int64),
             "attention_mask": np.ones((batch, past + rows), np.int64)}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((batch, value.shape[1], past, head_size),
                                         dtypes[value.type])
    return feeds


def _engine_table(result: dict) -> str:
    plan = result["plan"]
    decode = summarize(result["seconds"]["decode"])
    rows = [[name, f"{summarize(values).median * 1000:.1f}",
             f"{summarize(values).median / decode.median:.2f}x"]
            for name, values in result["seconds"].items()]
    return (markdown_table(["form", "ms (median)", f"against a [{plan['batch']}, 1] decode"],
                           rows)
            + f"\n\nB = {plan['batch']} rows, k = {plan['k']}, past {plan['past']} positions"
            + ("" if result["batched_refused"] is None
               else "; one batched forward: refused by ONNX Runtime "
                    f"({result['batched_refused']})"))


def _ratio_table(result: dict, goal: float) -> str:
    rows = []
    for length, spec in result["speeds"][SPEC].items():
        plain = result["speeds"][PLAIN][length]
        ratios = summarize(s / p for s, p in zip(spec, plain))
        accepted, drafted = result["kept"].get(length, (0, 0))
        rows.append([length, f"{summarize(spec).median:.1f}", f"{summarize(plain).median:.1f}",
                     f"{ratios.median:.2f}x ({ratios.low:.2f}-{ratios.high:.2f})",
                     f"{accepted}/{drafted}" + (f" ({accepted / drafted:.0%})" if drafted else ""),
                     "met" if ratios.median >= goal else "missed"])
    rate = result["accepted"] / result["drafted"] if result["drafted"] else 0.0
    period = result["continues_period"]
    compared = (f"greedy tokens identical: {result['identical']}"
                if result["sampling"] is None else
                f"sampled ({result['sampling']}), one seed per round and "
                "prompt (the systems' tokens differ by design)")
    copied = result["copied"]
    return (markdown_table(["prompt", "speculative tok/s", "plain tok/s",
                            "ratio (spread)", "drafts kept", f"goal >= {goal}x"], rows)
            + f"\n\ndrafted {result['drafted']}, accepted {result['accepted']} "
              f"({rate:.0%}); {compared}; tokens repeating what followed their previous "
              f"token last time: plain {copied[PLAIN]:.1%}, speculative {copied[SPEC]:.1%}"
            + ("" if period[PLAIN] is None
               else f"; output continuing the prompt's period: plain {period[PLAIN]:.0%}, "
                    f"speculative {period[SPEC]:.0%}"))


def cycle_ratios(times: dict[str, list[float]], system: str) -> str:
    """The median and spread of `system`'s forward over its own cycle's decode step."""
    ratios = summarize(t / d for t, d in zip(times[system], times["decode"], strict=True))
    return f"{ratios.median:.2f}x ({ratios.low:.2f}-{ratios.high:.2f})"


def _cost_table(result: dict) -> str:
    times, bare = result["times"], result["bare"]
    rows = []
    for system, values in times.items():
        cost, plain = summarize(values), summarize(bare[system])
        name = ("decode (1 row)" if system == "decode"
                else f"verify {system} ({int(system[2:]) + 1} rows)")
        rows.append([name,
                     f"{cost.median * 1000:.1f} ({cost.low * 1000:.1f}-{cost.high * 1000:.1f})",
                     cycle_ratios(times, system),
                     f"{plain.median * 1000:.1f} ({plain.low * 1000:.1f}-{plain.high * 1000:.1f})",
                     cycle_ratios(bare, system)])
    return (markdown_table(["forward", "ms (spread)", "against its cycle's decode (spread)",
                            "bare ORT ms (spread)", "bare ORT against its decode"], rows)
            + f"\n\npast {result['past']} positions; goal <= 1.5x for k=4; every system runs "
              "once per cycle, cycles in rotating order; bare ORT: the model's own graph on "
              "one plain CPU session")


if __name__ == "__main__":
    sys.exit(main())
