"""Progress bars on stderr that stay readable where stderr is a log file rather than a terminal.

tqdm redraws a bar in place: every update writes a carriage return and the bar again, several times
a second. On a terminal that is one line; in a CI log or `make demo > demo.log 2>&1` it is one
line of thousands of redraws. `progress_bar` keeps tqdm's bar on a terminal and elsewhere redraws at
most every LOG_INTERVAL_S seconds, each redraw on a line of its own (and the final state at the end).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 10.0  # seconds between a log's progress lines


class _LogLines:
    """A log's view of a bar: tqdm writes "\\r" + status + padding per redraw; each becomes a line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:  # a bar cleared on close (leave=False) writes blanks only
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(file: TextIO | None = None, **options: Any) -> tqdm:
    """tqdm on `file` (stderr by default) with `options`; where it is no terminal, a line per
    LOG_INTERVAL_S seconds instead of a bar redrawn in place (`disable=None`, as in tqdm: no bar there)."""
    stream = sys.stderr if file is None else file
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        if "disable" in options and options["disable"] is None:  # tqdm's "only on a terminal"
            options["disable"] = True
        options.setdefault("mininterval", LOG_INTERVAL_S)
        options.setdefault("maxinterval", 3 * options["mininterval"])  # tqdm forces a redraw past it
        options.setdefault("ncols", 100)  # no terminal width to follow
        stream = _LogLines(stream)
    return tqdm(file=stream, **options)
