"""Where the verbs write: progress lines for people, or one JSON document for programs (--format json)."""

from __future__ import annotations

import json
import sys

JSON = False  # set by main for --format json: stdout carries one JSON document, progress goes to stderr


def say(message: str) -> None:
    print(message, file=sys.stderr if JSON else sys.stdout, flush=True)


def emit(data) -> None:
    """The command's result as JSON on stdout."""
    print(json.dumps(data, indent=2, default=str))
