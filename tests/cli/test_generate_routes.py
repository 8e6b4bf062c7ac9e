"""`onnx-chunk generate` routes static decoders to the static runner, every prompt of a dynamic
one to the engine's step, and checks every prompt before it runs any."""

import json

import pytest

from onnx_chunk.cli import main
from onnx_chunk.models.static_decoder import build_static_pair


@pytest.fixture(scope="module")
def static_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("static")
    build_static_pair(folder, "tiny", chunk_size=8, capacity=64)
    return folder


def test_a_static_model_is_detected_and_generated(static_folder, capsys):
    assert main(["generate", str(static_folder), "--random-prompt", "20",
                 "--max-new-tokens", "3", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(entry["tokens"]) == 3 and entry["aligned_len"] == 24 and entry["pad_count"] == 4


@pytest.mark.parametrize("extra,kind", [(["--capacity", "32"], "static"),
                                        (["--no-padding"], "static")])
def test_dynamic_options_are_refused_for_static_models(static_folder, capsys, extra, kind):
    assert main(["generate", str(static_folder), "--ids", "1,2", "--max-new-tokens", "2",
                 *extra]) == 2
    assert f"cannot be used with a {kind} decoder" in capsys.readouterr().err


def test_static_options_are_refused_for_dynamic_models(reference_model, capsys):
    assert main(["generate", str(reference_model("base")), "--ids", "1,2",
                 "--max-new-tokens", "2", "--kv-capacity", "64"]) == 2
    assert "cannot be used with a dynamic decoder" in capsys.readouterr().err


def test_every_prompt_is_checked_before_any_runs(reference_model, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3\n4 5 6\n7 99999\n")
    assert main(["generate", str(reference_model("base")), "--ids-file", str(ids),
                 "--max-new-tokens", "2", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "outside the vocabulary" in captured.err


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_prompts_of_an_ids_file_share_one_slot_and_do_not_leak(reference_model, tmp_path,
                                                                   capsys, variant):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5\n9 8 7\n1 2 3 4 5\n")
    assert main(["generate", str(reference_model(variant)), "--ids-file", str(ids),
                 "--max-new-tokens", "4", "--provider", "cpu", "--json"]) == 0
    first, second, third = (json.loads(line)["tokens"]
                            for line in capsys.readouterr().out.strip().splitlines())
    assert first == third and len(second) == 4


@pytest.mark.parametrize("extra", [[], ["--batch", "2"], ["--no-padding"],
                                   ["--prompt", "hello"]])
def test_every_dynamic_body_is_a_request_on_the_engines_step(tmp_path, capsys, monkeypatch,
                                                              extra):
    """Whatever the flags, each prompt of a dynamic decoder is one `Runtime.submit` (the
    engine's step); no lone sequence generates."""
    from onnx_chunk.runtime import Runtime, Sequence
    from tests.exports.corpus import ROOT

    submitted = []
    submit = Runtime.submit

    def counting(self, prompt_ids, max_new_tokens, **options):
        submitted.append(len(prompt_ids))
        return submit(self, prompt_ids, max_new_tokens, **options)

    def refused(self, *args, **options):
        raise AssertionError("a lone sequence generated")

    monkeypatch.setattr(Runtime, "submit", counting)
    monkeypatch.setattr(Sequence, "stream", refused)
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5\n9 8 7\n")
    source = [] if "--prompt" in extra else ["--ids-file", str(ids)]
    assert main(["generate", str(ROOT / "genai-llama-fp32"), *source, *extra,
                 "--max-new-tokens", "3", "--provider", "cpu", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(submitted) == len(out) == (1 if "--prompt" in extra else 2)


def test_each_chunk_is_reported_with_the_width_it_ran_at(reference_model, capsys):
    """18 tokens at W=16 with the ladder: a chunk of 16, then 2 rows padded to 6."""
    assert main(["generate", str(reference_model("base")), "--random-prompt", "18",
                 "--max-new-tokens", "2", "--chunk-size", "16", "--capacity", "128",
                 "--provider", "cpu", "--specialize", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["chunks"] == [[16, 16], [2, 6]]
    assert entry["stats"]["padding"] == "repeat" and entry["stopped_by_eos"] is False
