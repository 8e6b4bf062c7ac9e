"""Typed errors raised by onnx-chunk; the CLI turns each into one line and an exit code.

Each class also derives from the built-in exception it means (`ConfigError` is a `ValueError`,
`ProviderError` a `RuntimeError`, `OutputError` an `OSError`, ...), so a caller's handler for
the built-in catches it too; `except OnnxChunkError` catches every one of them.
"""

from __future__ import annotations


class OnnxChunkError(Exception):
    """Base of every error onnx-chunk raises on purpose.

    Messages say what was expected, what was found and what to do.
    """

    exit_code = 2


class ModelLoadError(OnnxChunkError, ValueError):
    """A model file is missing, unreadable, corrupt or has broken external data."""


class ModelStructureError(OnnxChunkError, ValueError):
    """A model loads but its graph does not have the structure an operation needs."""


class ConfigError(OnnxChunkError, ValueError):
    """Impossible sizes, unknown presets or contradictory options."""


class OutputError(OnnxChunkError, OSError):
    """An output path cannot be written."""


class InputError(OnnxChunkError, ValueError):
    """Bad request data: empty prompts, token ids outside the vocabulary, wrong dtypes."""


class SequenceBusyError(InputError):
    """A call on a sequence while another call or stream is still live on it."""


class CapacityError(InputError):
    """A request would write past the KV cache's physical capacity."""


class ProviderError(OnnxChunkError, RuntimeError):
    """An execution provider was asked for but cannot be used on this machine."""


class ClosedError(OnnxChunkError, RuntimeError):
    """A runtime or a sequence was used after its close()."""


class QueueFullError(OnnxChunkError, RuntimeError):
    """A request was submitted while the engine's waiting queue was full."""


class InstallError(OnnxChunkError, ImportError):
    """The installation is broken: ONNX Runtime missing, or two of its wheels installed."""
