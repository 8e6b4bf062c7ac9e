"""lm-evaluation-harness against the live server: `local-completions` on a loglikelihood task
and a generate_until task, `local-chat-completions` on a generate_until task (small local task
files). The loglikelihoods the harness reports equal the log-softmax of a plain ONNX Runtime
forward of the whole sequence through the same export; its generations equal the runtime's
own greedy text."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnx_chunk.sampling import GREEDY
from onnx_chunk.text.generation import generate_text
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.full_forward import full_sequence_logprobs
from tests.serve.conftest import EXPORT, MODEL_NAME

# One worker runs the module: its fixtures (the server, the harness venv) are made once, and two
# workers never make the venv side by side.
pytestmark = pytest.mark.xdist_group("lm_eval")

TOLERANCE = 1e-4
CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a tower"],
     "answer": 0},
    {"question": "Two plus two makes", "choices": [" four", " five"], "answer": 0},
    {"question": "Water boils at one hundred", "choices": [" degrees", " cats", " miles"],
     "answer": 0},
]
UNTIL_DOCS = [{"question": "Name a city:", "answer": "Paris"},
              {"question": "Count to three:", "answer": "one two three"}]
NEW_TOKENS = 6


def _task_files(folder: Path) -> None:
    (folder / "choice.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in CHOICE_DOCS))
    (folder / "until.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in UNTIL_DOCS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "choice.yaml").write_text(
        f"task: onnx_chunk_choice\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'choice.jsonl'}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "until.yaml").write_text(
        f"task: onnx_chunk_until\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'until.jsonl'}\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n"
        f"  max_gen_toks: {NEW_TOKENS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _harness(python: Path, folder: Path, model: str, endpoint: str, tasks: tuple[str, ...],
             url: str, *extra: str) -> dict[str, list[dict]]:
    """Run the harness on `tasks` (one start: importing the harness takes most of a run);
    the samples it logged, per task."""
    out = folder / f"out-{model}"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(folder / "hf"),
                   "TOKENIZERS_PARALLELISM": "false"}
    arguments = (f"model={MODEL_NAME},base_url={url}/v1/{endpoint},num_concurrent=1,"
                 "max_retries=1,timeout=120")
    if model == "local-completions":
        arguments += f",tokenizer_backend=huggingface,tokenizer={EXPORT},max_length=256"
    else:
        arguments += ",tokenizer_backend=none"
    done = subprocess.run(
        [str(python), "-m", "lm_eval", "--model", model, "--model_args", arguments,
         "--tasks", ",".join(tasks), "--include_path", str(folder), "--output_path", str(out),
         "--log_samples", "--batch_size", "1", *extra],
        capture_output=True, text=True, env=environment, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    logged = {}
    for task in tasks:
        samples = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        assert samples, done.stderr[-2000:]
        logged[task] = [json.loads(line) for line in samples[-1].read_text().splitlines()]
    return logged


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval")
    _task_files(folder)
    return folder


@pytest.fixture(scope="module")
def completions(live, lmeval_python, tasks) -> dict[str, list[dict]]:
    """Both tasks through `local-completions` (token-id prompts, echo and logprobs)."""
    return _harness(lmeval_python, tasks, "local-completions", "completions",
                    ("onnx_chunk_choice", "onnx_chunk_until"), live.url)


def test_loglikelihoods_equal_a_full_sequence_forward(live, completions):
    samples = completions["onnx_chunk_choice"]
    tokenizer = tokenizer_of(live.runtime)
    assert len(samples) == len(CHOICE_DOCS)
    checked = 0
    for sample in samples:
        for (context, continuation), response in zip(_arguments(sample), sample["resps"]):
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = tokenizer.encode(context, add_special_tokens=False)
            reference = full_sequence_logprobs(EXPORT, whole)
            expected = sum(reference[position - 1, whole[position]]
                           for position in range(len(context_ids), len(whole)))
            logprob, greedy = response[0]
            assert abs(float(logprob) - expected) <= TOLERANCE, (context, continuation)
            greedy = greedy in (True, "True")
            argmax = all(np.argmax(reference[position - 1]) == whole[position]
                         for position in range(len(context_ids), len(whole)))
            assert greedy == argmax
            checked += 1
    assert checked == sum(len(doc["choices"]) for doc in CHOICE_DOCS)


def test_generate_until_through_completions(live, completions):
    samples = completions["onnx_chunk_until"]
    assert len(samples) == len(UNTIL_DOCS)
    for sample in samples:
        context = _context(sample)
        expected = generate_text(live.runtime, context, NEW_TOKENS, sampling=GREEDY, stop="\n")
        assert sample["resps"][0][0] == expected.text


def test_generate_until_through_chat_completions(live, lmeval_python, tasks):
    samples = _harness(lmeval_python, tasks, "local-chat-completions", "chat/completions",
                       ("onnx_chunk_until",), live.url,
                       "--apply_chat_template")["onnx_chunk_until"]
    assert len(samples) == len(UNTIL_DOCS)
    for sample, doc in zip(sorted(samples, key=lambda sample: sample["doc_id"]), UNTIL_DOCS):
        messages = [{"role": "user", "content": doc["question"]}]
        expected = generate_text(live.runtime, messages, NEW_TOKENS, sampling=GREEDY, stop="\n")
        assert sample["resps"][0][0] == expected.text


def _arguments(sample: dict) -> list[tuple[str, ...]]:
    """The request arguments the harness logged for a sample, in order."""
    return [tuple(argument[f"arg_{number}"] for number in range(len(argument)))
            for argument in sample["arguments"].values()]


def _context(sample: dict) -> str:
    return _arguments(sample)[0][0]
