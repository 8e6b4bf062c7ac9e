"""The typed errors a pass's `requires()` raises, in the form onnx_ir's pass infrastructure keeps.

onnx_ir's `PassBase.__call__` (onnx_ir 1.1.0, src/onnx_ir/passes/_pass_infra.py) runs
`requires(model)` before `call(model)`: a `PreconditionError` leaves it as raised, any other
exception is wrapped in a new `PreconditionError`. A refusal of ours is both the typed error a
caller of onnx_chunk catches (ModelStructureError, ConfigError) and a `PreconditionError`, so it
reaches a caller of the pass unchanged. `Sequential` wraps whatever a pass raises in a
`PassError`; the pipeline (`convert_model`, `analyze`) hands our errors back unwrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError


class ModelPreconditionError(ModelStructureError, ir.passes.PreconditionError):
    """A model a pass does not apply to, refused by its `requires()` before it changes it."""


class ConfigPreconditionError(ConfigError, ir.passes.PreconditionError):
    """An option a pass cannot honour on this model, refused by its `requires()`."""


@contextlib.contextmanager
def precondition() -> Iterator[None]:
    """Raise a ModelStructureError or ConfigError of the checks inside as the precondition
    error of the same kind and message."""
    try:
        yield
    except ir.passes.PreconditionError:
        raise
    except ModelStructureError as error:
        raise ModelPreconditionError(str(error)) from error
    except ConfigError as error:
        raise ConfigPreconditionError(str(error)) from error
