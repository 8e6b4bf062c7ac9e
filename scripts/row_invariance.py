"""Where a row's numbers depend on how its forward is cut: op by op, on plain ONNX Runtime.

A probe of the kernels, not of the runtime: it runs the decoder's graph on a bare
`InferenceSession` (one KV per layer, fed back grown, as a plain ORT loop does), so what it
finds is ONNX Runtime's own behaviour. Findings: docs/row_grouping.md.

* ``bisect``: one forward of FIRST + SECOND rows from an empty cache against a forward of FIRST
  rows followed by SECOND rows on its KV, every intermediate value of the graph ONNX Runtime
  optimised (the optimised graph is saved once, then run with optimisations off, so the
  kernels are the served ones) compared on the SECOND rows: the root values, whose row inputs
  are identical while they differ, name the op that rounds by the cut. ``--batch N`` instead
  compares one decode row alone with the same row in a batch of N rows (the others another
  token each).
* ``attention``: one GroupQueryAttention node of random inputs (heads, KV heads, head size),
  every prompt width n from 3 to ``--widths`` cut as (n - 2, 2) against one forward of n rows:
  the rows that differ. ``ORT_GQA_DISABLE_FLASH_ATTENTION=1`` in the environment switches
  ONNX Runtime 1.32's CPU flash path off.

    python scripts/row_invariance.py bisect --model qwen05-int4 --cut 512,1 [--threads 2]
    python scripts/row_invariance.py bisect --model qwen05-int4 --batch 8
    python scripts/row_invariance.py attention --heads 14 --kv-heads 2 --head-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench.models import model_folder  # noqa: E402


def _cpu() -> str:
    """The CPU model and the vector extensions its CPUID reports (numpy's own detection, so an
    emulated CPU shows its own), for the printout."""
    from numpy._core._multiarray_umath import __cpu_features__ as features  # type: ignore[import-not-found]

    name = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        name = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("model name")), name)
    wanted = ["AVX2", "FMA3", "AVX512F", "AVX512_CLX", "AVX512_SPR"]
    found = ", ".join(flag for flag in wanted if features.get(flag)) or "no AVX2"
    return f"{name} (CPUID: {found})"


def _session(path: Path, threads: int, optimized: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _instrumented(folder: Path, threads: int) -> tuple[Path, list[tuple[str, str, str]]]:
    """The graph as ONNX Runtime optimises it, every node output made a graph output, written
    (with the weights it optimised) to a scratch folder, never beside the model."""
    scratch = Path(tempfile.mkdtemp(prefix="row-invariance-"))
    optimized = scratch / f"optimized_t{threads}.onnx"
    if not optimized.is_file():
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.optimized_model_filepath = str(optimized)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", optimized.name + ".data")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(folder / "model.onnx"), options,
                             providers=["CPUExecutionProvider"])
    model = onnx.load(str(optimized), load_external_data=False)
    outputs = {value.name for value in model.graph.output}
    values = []
    for node in model.graph.node:
        for name in node.output:
            if name and name not in outputs:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                values.append((node.op_type, node.name, name))
    instrumented = scratch / f"instrumented_t{threads}.onnx"
    onnx.save(model, str(instrumented))
    return instrumented, values


class Decoder:
    """A builder export on a bare session: ids and a past in, every output out."""

    def __init__(self, folder: Path, session: ort.InferenceSession) -> None:
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        self.session = session
        self.kv = [value.name for value in session.get_inputs()
                   if value.name.startswith("past_key_values")]
        self.heads = config["decoder"]["num_key_value_heads"]
        self.head_size = config["decoder"]["head_size"]
        self.vocab = config["vocab_size"]
        self.names = [value.name for value in session.get_outputs()]

    def run(self, ids: np.ndarray, past: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """A forward of ids [batch, rows] on `past` (None: empty)."""
        batch, rows = ids.shape
        length = 0 if past is None else next(iter(past.values())).shape[2]
        feed = {"input_ids": ids.astype(np.int64),
                "attention_mask": np.ones((batch, length + rows), np.int64)}
        for name in self.kv:
            feed[name] = (past[name] if past is not None
                          else np.zeros((batch, self.heads, 0, self.head_size), np.float32))
        return dict(zip(self.names, self.session.run(None, feed)))

    def present(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: outputs[name.replace("past_key_values", "present")] for name in self.kv}


def _rows(value: np.ndarray, axis: int, rows: slice) -> np.ndarray:
    index = [slice(None)] * value.ndim
    index[axis] = rows
    return value[tuple(index)]


def _differences(whole: dict, part: dict, rows: slice, count: int) -> dict[str, float]:
    """Max |difference| per value over `rows` of `whole` against all `count` rows of `part`
    (a value whose row axis is found: its size there is the forward's rows)."""
    found = {}
    for name, value in whole.items():
        other = part.get(name)
        if other is None or value.dtype.kind != "f" or value.ndim != other.ndim:
            continue
        for axis in range(value.ndim):
            if other.shape[axis] == count and value.shape[axis] == rows.stop:
                chosen = _rows(value, axis, rows)
                if chosen.shape == other.shape:
                    found[name] = float(np.abs(chosen.astype(np.float64) - other).max())
                break
    return found


def _roots(model: onnx.ModelProto, differences: dict[str, float]) -> list[tuple[str, str, float]]:
    """Nodes whose output differs while every row-carrying input they read is identical."""
    roots = []
    for node in model.graph.node:
        outs = [differences[name] for name in node.output if name in differences]
        if not outs or max(outs) == 0:
            continue
        if all(differences[name] == 0 for name in node.input if name in differences):
            roots.append((node.op_type, node.name, max(outs)))
    return roots


def bisect(args: argparse.Namespace) -> None:
    folder = model_folder(args.model)
    path, _ = _instrumented(folder, args.threads)
    decoder = Decoder(folder, _session(path, args.threads, optimized=False))
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(args.seed)
    if args.batch:
        ids = rng.integers(0, decoder.vocab, (args.batch, args.past + 1))
        ids[1:, :args.past] = ids[0, :args.past]
        past = decoder.present(decoder.run(ids[:1, :args.past], None))
        batched = {name: np.repeat(value, args.batch, axis=0) for name, value in past.items()}
        alone = decoder.run(ids[:1, args.past:], past)
        together = decoder.run(ids[:, args.past:], batched)
        first = {name: value[:1] for name, value in together.items()
                 if value.ndim and value.shape[0] == args.batch}
        differences = _differences(first, alone, slice(0, 1), 1)
        what = f"one decode row at past {args.past} alone against the same row among {args.batch}"
    else:
        first_rows, second_rows = args.cut
        ids = rng.integers(0, decoder.vocab, (1, first_rows + second_rows))
        whole = decoder.run(ids, None)
        head = decoder.run(ids[:, :first_rows], None)
        tail = decoder.run(ids[:, first_rows:], decoder.present(head))
        differences = _differences(whole, tail, slice(first_rows, first_rows + second_rows),
                                   second_rows)
        what = (f"rows {first_rows}..{first_rows + second_rows - 1}: one forward of "
                f"{first_rows + second_rows} rows against {first_rows} + {second_rows}")
    print(f"{_cpu()}; onnxruntime {ort.__version__}, {args.threads} thread(s)")
    print(what)
    roots = _roots(model, differences)
    for op, name, worst in roots:
        print(f"  root: {op} {name}: max |diff| {worst:.3g}")
    differing = sum(1 for value in differences.values() if value > 0)
    print(f"  {differing} of {len(differences)} values differ; {len(roots)} root(s); logits "
          f"max |diff| {differences.get('logits', float('nan')):.3g}")


def _attention_model(heads: int, kv_heads: int, head_size: int) -> bytes:
    shapes: dict[str, list[str | int | None]] = {
        "q": [1, "S", heads * head_size], "k": [1, "S", kv_heads * head_size],
        "v": [1, "S", kv_heads * head_size], "pk": [1, kv_heads, "P", head_size],
        "pv": [1, kv_heads, "P", head_size]}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
              for name, shape in shapes.items()]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in ("out", "present_k", "present_v")]
    node = helper.make_node("GroupQueryAttention", [value.name for value in inputs],
                            ["out", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=heads, kv_num_heads=kv_heads)
    model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21),
                                             helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def attention(args: argparse.Namespace) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(_attention_model(args.heads, args.kv_heads, args.head_size),
                                   options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(args.seed)
    count = args.widths + 1
    q, k, v = (rng.standard_normal((1, count, heads * args.head_size)).astype(np.float32)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    empty = np.zeros((1, args.kv_heads, 0, args.head_size), np.float32)

    def run(begin: int, end: int, past_k: np.ndarray, past_v: np.ndarray) -> list[np.ndarray]:
        return session.run(None, {"q": q[:, begin:end], "k": k[:, begin:end],
                                  "v": v[:, begin:end], "pk": past_k, "pv": past_v,
                                  "seqlens_k": np.array([end - 1], np.int32),
                                  "total": np.array(end, np.int32)})

    parted = []
    for width in range(max(args.start, 3), count):
        whole = run(0, width, empty, empty)[0]
        head, past_k, past_v = run(0, width - 2, empty, empty)
        tail = run(width - 2, width, past_k, past_v)[0]
        cut = np.concatenate([head, tail], axis=1)
        rows = np.flatnonzero(np.abs(whole - cut).max(axis=(0, 2)))
        if rows.size:
            parted.append((width, rows.tolist()))
    flash = os.environ.get("ORT_GQA_DISABLE_FLASH_ATTENTION", "0") not in ("1", "true")
    print(f"{_cpu()}; onnxruntime {ort.__version__}, {args.threads} thread(s), flash path "
          f"{'on' if flash else 'off'}")
    print(f"GroupQueryAttention {args.heads}/{args.kv_heads} heads of {args.head_size}: "
          f"widths n = {max(args.start, 3)}..{args.widths}, (n - 2) + 2 against n rows")
    print(f"  {len(parted)} widths part; the rows: "
          + (", ".join(f"n={width}: {rows}" for width, rows in parted[:12]) or "none"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("bisect", help="the first op whose rows depend on the cut")
    one.add_argument("--model", required=True, help="a bench model name or a builder folder")
    one.add_argument("--cut", default="512,1",
                     type=lambda text: tuple(int(part) for part in text.split(",")))
    one.add_argument("--batch", type=int, default=0, help="compare a decode row alone and "
                     "among N rows instead of a cut")
    one.add_argument("--past", type=int, default=64, help="--batch: the shared past")
    one.add_argument("--threads", type=int, default=2)
    one.add_argument("--seed", type=int, default=0)
    one.set_defaults(run=bisect)
    scan = commands.add_parser("attention", help="one GroupQueryAttention, every width")
    scan.add_argument("--heads", type=int, default=14)
    scan.add_argument("--kv-heads", type=int, default=2)
    scan.add_argument("--head-size", type=int, default=64)
    scan.add_argument("--widths", type=int, default=700, help="the widest forward")
    scan.add_argument("--start", type=int, default=3, help="the narrowest forward")
    scan.add_argument("--threads", type=int, default=2)
    scan.add_argument("--seed", type=int, default=0)
    scan.set_defaults(run=attention)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
