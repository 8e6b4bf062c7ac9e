"""`onnx-chunk generate --ids-file F --batch N`: the prompts through the batch engine, JSON
lines in input order, the same tokens as --batch 1."""

import json

from onnx_chunk.cli import main
from tests.cli_output import one_error_line


def _run(capsys, path, ids, *extra):
    code = main(["generate", str(path), "--ids-file", str(ids), "--max-new-tokens", "6",
                 "--provider", "cpu", "--capacity", "128", "--chunk-size", "8", "--json",
                 *extra])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.strip().splitlines()]


def test_batch_serves_every_prompt_in_input_order_with_the_tokens_of_batch_1(
        reference_model, tmp_path, capsys):
    path = reference_model("base")
    ids = tmp_path / "prompts.txt"
    ids.write_text("1 2 3 4 5\n" + " ".join(map(str, range(7, 40))) + "\n3\n9 8 7 6 5 4 3 2 1\n")
    code, one = _run(capsys, path, ids)
    assert code == 0
    code, batched = _run(capsys, path, ids, "--batch", "3")
    assert code == 0
    assert [entry["prompt"] for entry in batched] == [0, 1, 2, 3]
    assert [entry["tokens"] for entry in batched] == [entry["tokens"] for entry in one]
    assert [entry["prompt_tokens"] for entry in batched] == [5, 33, 1, 9]
    assert all(entry["finish_reason"] in ("length", "stop") for entry in batched)
    assert batched[1]["prefill_chunks"] == 5
    assert batched[-1]["stats"]["max_batch"] == 3


def test_batch_is_refused_for_a_static_decoder(reference_model, tmp_path, capsys):
    ids = tmp_path / "prompts.txt"
    ids.write_text("1 2 3\n")
    code = main(["generate", str(reference_model("base")), "--ids-file", str(ids),
                 "--max-new-tokens", "2", "--static", "--batch", "2"])
    assert code == 2
    one_error_line(capsys, "--batch")


def test_batch_is_refused_with_a_text_prompt(reference_model, capsys):
    code = main(["generate", str(reference_model("base")), "--prompt", "hello",
                 "--max-new-tokens", "2", "--batch", "2"])
    assert code == 2
    one_error_line(capsys, "--batch", "--prompt")
