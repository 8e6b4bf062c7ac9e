"""Error classes: each is also the built-in it means, and none is re-wrapped by accident."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from onnx_chunk import errors
from onnx_chunk.graph.metadata import KV_CAPACITY_KEY, PADDING_KEY, read_kv_capacity, read_plan

PACKAGE = Path(errors.__file__).resolve().parent

BUILT_INS = {
    "ModelLoadError": ValueError, "ModelStructureError": ValueError, "ConfigError": ValueError,
    "InputError": ValueError, "SequenceBusyError": ValueError, "CapacityError": ValueError,
    "OutputError": OSError, "ProviderError": RuntimeError, "ClosedError": RuntimeError,
    "QueueFullError": RuntimeError, "InstallError": ImportError,
}

# Every (file, built-in) handler in the package that could catch one of our errors, with why it
# does not swallow one. A new such handler fails the test until it is reviewed here.
REVIEWED_HANDLERS = {
    ("serve/routing.py", "ValueError"): "request_key: a body the replica will refuse gets no "
                                        "routing key; the replica answers it with the error",
    ("_onnxruntime_wheels.py", "OSError"): "installed_wheels: only os.listdir of a sys.path "
                                           "entry (a zip, a missing folder) is guarded",
    ("cli/validate.py", "OSError"): "an OutputError handler above re-raises ours",
    ("graph/model_io.py", "OSError"): "an OutputError handler above re-raises ours; the rest "
                                      "read files",
    ("staged_output.py", "OSError"): "stale_staging: wraps reading a staging folder's owner file "
                                     "only",
    ("models/__init__.py", "OSError"): "an OutputError handler above re-raises ours",
    ("models/static_decoder.py", "OSError"): "an OutputError handler above re-raises ours",
    ("static/fix_shapes.py", "OSError"): "an OutputError handler above; hashing raises none",
    ("graph/metadata.py", "ValueError"): "a ModelStructureError handler above re-raises ours",
    ("graph/model_folder.py", "ValueError"): "wraps json.loads only",
    ("graph/model_folder.py", "OSError"): "wraps reading the file only",
    ("graph/model_io.py", "ValueError"): "wraps onnx.load only",
    ("runtime/device/session_factory.py", "OSError"): "wraps numpy.memmap only",
    ("validate/structure.py", "OSError"): "wraps onnx's checker only",
    ("runtime/device/provider.py", "ValueError"): "wraps an enum lookup only",
    ("runtime/device/memory.py", "ValueError"): "ort_cudart_soname: wraps reading the CUDA "
                                                "provider library's ELF header only",
    ("runtime/state/ports.py", "ValueError"): "wraps numpy_dtype, which raises a plain ValueError",
    ("runtime/device/session_factory.py", "ValueError"): "wraps numpy.memmap only",
    ("runtime/engine/request_queue.py", "ValueError"): "wraps deque.remove only",
    ("serve/generation.py", "RuntimeError"): "wraps loop.call_soon_threadsafe only",
    ("cli/generate.py", "OSError"): "wraps Path.read_bytes only",
    ("calibration.py", "OSError"): "wraps Path.read_bytes only",
    ("cli/serve.py", "OSError"): "wraps socket binding only",
    ("serve/streaming.py", "OSError"): "wraps a write to the client only",
    ("serve/body.py", "ValueError"): "wraps json.loads of the request body only",
    ("serve/ray.py", "RuntimeError"): "wraps asyncio.get_running_loop only",
    ("validate/numerics.py", "OSError"): "wraps last_row_graph only, which raises none of ours",
    ("validate/reference.py", "OSError"): "wraps linking the weights and writing the graph only",
    ("runtime/device/memory.py", "OSError"): "wraps reading /proc and loading a library only",
    ("text/chat_template.py", "OSError"): "wraps reading a file only",
    ("graph/model_io.py", "RuntimeError"): "wraps onnx.load only",
    ("graph/model_file.py", "OSError"): "wraps reading the file only",
    ("sampling_ranges.py", "ValueError"): "wraps unpacking the logit_bias pairs only",
    ("structured/constraint.py", "ValueError"): "wraps llguidance's schema compiler only",
    ("validate/engine.py", "RuntimeError"): "an OnnxChunkError handler above reports ours",
    ("validate/runs.py", "ValueError"): "an OnnxChunkError handler above re-raises ours; the "
                                        "sampler's refusal of a row with no finite maximum",
    ("analysis_cache.py", "OSError"): "wraps stat, reading and writing cache entries only; a "
                                      "load's own errors come after, from the analysis",
    ("analysis_cache.py", "ValueError"): "wraps json.loads of an entry; read_plan's "
                                         "ModelStructureError means a damaged entry: analyse again",
    ("validate/agreement.py", "RuntimeError"): "beside OnnxChunkError: both become the check's "
                                               "one-line refusal or failure",
}


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_each_error_is_also_the_built_in_it_means(name):
    cls = getattr(errors, name)
    error = cls("what was found; what to do")
    assert isinstance(error, errors.OnnxChunkError) and isinstance(error, BUILT_INS[name])
    assert str(error) == "what was found; what to do"
    try:
        raise error
    except BUILT_INS[name] as caught:  # a caller's handler for the built-in catches ours
        assert caught is error


def test_every_error_class_derives_from_a_built_in_besides_exception():
    classes = [value for value in vars(errors).values()
               if isinstance(value, type) and issubclass(value, errors.OnnxChunkError)
               and value is not errors.OnnxChunkError]
    assert sorted(cls.__name__ for cls in classes) == sorted(BUILT_INS)


def _handlers() -> set[tuple[str, str]]:
    watched = {"ValueError", "RuntimeError", "OSError", "IOError", "EnvironmentError"}
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                for caught in types:
                    if isinstance(caught, ast.Name) and caught.id in watched:
                        found.add((path.relative_to(PACKAGE).as_posix(), caught.id))
    return found


def test_every_handler_of_a_built_in_our_errors_derive_from_is_reviewed():
    unreviewed = _handlers() - set(REVIEWED_HANDLERS)
    assert not unreviewed, (f"handlers that may swallow an onnx_chunk error: {sorted(unreviewed)};"
                            " check each and list it in REVIEWED_HANDLERS")


def test_damaged_metadata_json_is_reported_once_not_re_wrapped():
    with pytest.raises(errors.ModelStructureError) as raised:
        read_kv_capacity({KV_CAPACITY_KEY: "{not json"})
    assert str(raised.value).startswith(f"metadata key {KV_CAPACITY_KEY!r} is not valid JSON")
    assert "malformed" not in str(raised.value)


def test_damaged_padding_json_in_a_plan_is_reported_once(reference_model, tmp_path):
    import onnx

    from onnx_chunk.graph.metadata import SCHEMA_VERSION_KEY

    props = {entry.key: entry.value for entry in
             onnx.load(str(_converted(reference_model, tmp_path)),
                       load_external_data=False).metadata_props}
    assert SCHEMA_VERSION_KEY in props
    props[PADDING_KEY] = "{not json"
    with pytest.raises(errors.ModelStructureError) as raised:
        read_plan(props)
    assert "not valid JSON" in str(raised.value) and "malformed" not in str(raised.value)


def test_a_refused_output_is_reported_once_not_re_wrapped(reference_model, tmp_path):
    from onnx_chunk.graph.model_io import load_model, save_model

    model_path = reference_model()
    folder = tmp_path / "out"
    save_model(load_model(model_path), folder / "other.onnx", companions_from=model_path.parent)
    with pytest.raises(errors.OutputError) as raised:  # its genai_config.json names other.onnx
        save_model(load_model(model_path), folder / "mine.onnx",
                   companions_from=model_path.parent)
    assert "belongs to another model" in str(raised.value)
    assert not str(raised.value).startswith("cannot write")


def _converted(reference_model, tmp_path: Path) -> Path:
    from onnx_chunk.cli import main

    out = tmp_path / "converted" / "model.onnx"
    assert main(["convert", str(reference_model()), "-o", str(out), "--chunk-size", "16"]) == 0
    return out
