"""The JSON every `--json` prints: one object per line or document, `"schema"` first.

`schema` is the version of the output's shape (docs/json.md): it grows by one when a field is
removed, renamed or changes meaning; new fields leave it as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SCHEMA = 1


def dumps(entry: Mapping[str, Any], **options: Any) -> str:
    """`entry` as JSON with the schema version as its first key (json.dumps's options)."""
    return json.dumps({"schema": SCHEMA, **entry}, **options)
