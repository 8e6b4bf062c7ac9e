"""KV cache calibration: the range of every key and value a float model writes to its cache.

`calibrate_kv(model_path, prompts)` loads the float model through the runtime's public API
(`onnx_chunk.load`), prefills each prompt on a fresh sequence, and reads each KV buffer after
the prefill: the largest magnitude per KV head and channel, over every position written, is
what `KVCacheQuantizationPass` turns into scales. Prompts are text (encoded with the model's
own tokenizer) or token ids; `read_calibration_file` reads either from a file, and
`BUILTIN_PROMPTS` is the default set.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onnx_chunk.errors import InputError, ModelStructureError
from onnx_chunk.passes.kv_quantization import Calibration, KVRange

logger = logging.getLogger(__name__)

# Varied English text (prose, dialogue, code, numbers, lists), so that the ranges cover more
# than one kind of input; each is one prompt.
BUILTIN_PROMPTS = (
    "The history of the city begins with a small settlement on the river, where traders "
    "stopped to rest their horses before crossing the mountains to the east.",
    "User: Can you explain how a hash table handles collisions?\nAssistant: A hash table "
    "maps each key to a bucket; when two keys share a bucket, it keeps both, either in a "
    "short list or by probing for the next free slot.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])",
    "Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Whisk the "
    "eggs and milk, then fold in the flour until the batter is smooth.",
    "In 1969, 1987 and 2024 the committee met on March 3rd, July 14th and November 30th; "
    "the budget rose from $1,250,000 to $3.7 million, an increase of 196%.",
    "Dear Ms. Alvarez, thank you for your letter of 12 May. We have reviewed your request "
    "and are pleased to confirm that the shipment will arrive next Tuesday.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs red and "
    "blue light, water is split, oxygen is released, and carbon dioxide is fixed into sugar.",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: Which planet is closest to the "
    "sun?\nA: Mercury.\nQ: How many legs does a spider have?\nA:",
)

_TOKEN_LINE = re.compile(r"^\s*\d+(\s*[,\s]\s*\d+)*\s*,?\s*$")


def read_calibration_file(path: Path) -> list[str] | list[list[int]]:
    """The prompts of a calibration file: one a line, text or token ids.

    A file whose every non-blank line is integers (separated by spaces or commas) is a
    token-id file; any other is text, one prompt a line. InputError (one line) when the file
    cannot be read, is not UTF-8 text, or holds no prompt.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InputError(f"cannot read the calibration file {str(path)!r}: "
                         f"{error.strerror or error}; give a readable text file, one prompt "
                         "a line") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"the calibration file {str(path)!r} is not UTF-8 text (byte "
                         f"{error.start}); give a text file, one prompt a line, or one line of "
                         "token ids per prompt") from error
    if "\x00" in text:
        raise InputError(f"the calibration file {str(path)!r} is not text (it holds NUL "
                         "bytes); give a text file, one prompt a line")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise InputError(f"the calibration file {str(path)!r} holds no prompt; give one "
                         "prompt a line")
    if all(_TOKEN_LINE.match(line) for line in lines):
        return [[int(token) for token in re.split(r"[,\s]+", line.strip().rstrip(","))]
                for line in lines]
    return lines


def calibrate_kv(model_path: Path, prompts: Sequence[str] | Sequence[Sequence[int]] | None = None,
                 *, source: str = "built-in prompts") -> Calibration:
    """Run the float model at `model_path` on `prompts` (default BUILTIN_PROMPTS) and return
    the largest magnitude each KV cache input held, per KV head and channel.

    Raises ModelStructureError when the model's cache is not float (already quantized) and
    InputError for prompts that are empty or outside the vocabulary.
    """
    import onnx_chunk

    if prompts is None:
        prompts = BUILTIN_PROMPTS
    encoded = _encode(model_path, prompts)
    # Room for the longest prompt, and never less than a window-sized cache's window.
    capacity = max(2, max(len(ids) for ids in encoded), _window(model_path))
    ranges: dict[str, np.ndarray] = {}
    with onnx_chunk.load(model_path, provider="cpu", capacity=capacity) as runtime:
        for ids in encoded:
            with runtime.open_sequence() as sequence:
                sequence.prefill(ids)
                buffers = sequence.buffers
                for port, buffer in zip(buffers.kv_ports, buffers.kv):
                    if port.dtype.kind != "f":
                        raise ModelStructureError(
                            f"the KV cache {port.input!r} is {port.dtype}, not float: "
                            "calibrate (and convert) the float-cache export")
                    values = np.abs(np.asarray(buffer.value.numpy(), dtype=np.float32))
                    # [batch, kv_heads, positions, head] -> [kv_heads, head]
                    amax = values.max(axis=(0, 2))
                    previous = ranges.get(port.input)
                    ranges[port.input] = amax if previous is None else np.maximum(previous,
                                                                                  amax)
    tokens = sum(len(ids) for ids in encoded)
    logger.info("calibrated %d KV caches on %d prompts (%d tokens)", len(ranges), len(encoded),
                tokens)
    return Calibration({name: KVRange(amax) for name, amax in ranges.items()},
                       prompts=len(encoded), tokens=tokens, source=source)


def _window(model_path: Path) -> int:
    """The widest sliding window of the model's KV caches (0 without one)."""
    from onnx_chunk.graph.chunk_plan import window_capacity
    from onnx_chunk.graph.model_folder import locate_model
    from onnx_chunk.graph.model_io import load_model
    from onnx_chunk.passes import analyze

    plan = analyze(load_model(locate_model(model_path).onnx_path))
    return window_capacity(plan.capacity_inputs)


def _encode(model_path: Path,
            prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Text through the model's tokenizer, ids as they are (the runtime checks the
    vocabulary when it prefills them)."""
    if not prompts:
        raise InputError("calibration needs at least one prompt")
    if all(isinstance(prompt, str) for prompt in prompts):
        from onnx_chunk.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path)
        encoded = [tokenizer.encode(str(prompt)) for prompt in prompts]
        encoded = [ids for ids in encoded if ids]
        if not encoded:
            raise InputError("the calibration prompts encode to no tokens; give longer text")
    else:
        encoded = [[int(token) for token in prompt] for prompt in prompts]
        if any(not ids for ids in encoded):
            raise InputError("a calibration prompt has no token ids")
    return encoded
