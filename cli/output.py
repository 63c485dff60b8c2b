"""`--json`: stdout carries exactly one JSON document, so `pdserve ... --json | jq` works.

While a `--json` command runs, everything else that would reach stdout goes to stderr instead:
Python prints and logging handlers bound to sys.stdout, and at the file-descriptor level whatever
native libraries (NIXL, UCX) and child processes (Ray workers, benchmark subprocesses) write to
fd 1. The command hands its one document to `emit_json`, which alone writes to the real stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

_json_out: TextIO | int | None = None  # where emit_json writes while stdout is reserved


@contextlib.contextmanager
def stdout_reserved_for_json() -> Iterator[None]:
    """Send stdout (sys.stdout and fd 1) to stderr for the duration; `emit_json` still reaches
    the original stdout."""
    global _json_out
    original = sys.stdout
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fd = os.dup(1)
    # The process's own stdout is written through the saved descriptor; a replaced sys.stdout
    # (pytest capture, contextlib.redirect_stdout) is written to as it is.
    _json_out = saved_fd if original is sys.__stdout__ else original
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = original
        _json_out = None


def emit_json(document: Any, indent: int | None = 2) -> None:
    """Write the command's one JSON document to stdout."""
    text = json.dumps(document, indent=indent, default=str) + "\n"
    out = _json_out
    if out is None:  # not under stdout_reserved_for_json (a command called as a function)
        sys.stdout.write(text)
        sys.stdout.flush()
    elif isinstance(out, int):
        data = text.encode()
        while data:
            data = data[os.write(out, data) :]
    else:
        out.write(text)
        out.flush()
