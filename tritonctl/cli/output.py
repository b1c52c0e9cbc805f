"""Where the verbs write: progress lines for people, or one JSON document for programs (--format json)."""

from __future__ import annotations

import json
import math
import sys

JSON = False  # set by main for --format json: stdout carries one JSON document, progress goes to stderr


def say(message: str) -> None:
    print(message, file=sys.stderr if JSON else sys.stdout, flush=True)


def _strict(data):
    """`data` with every NaN or infinity as null: strict JSON has neither (a model with no requests has no p99)."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _strict(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_strict(v) for v in data]
    return data


def emit(data) -> None:
    """The command's result as strict JSON on stdout."""
    print(json.dumps(_strict(data), indent=2, default=str, allow_nan=False))
