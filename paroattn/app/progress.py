"""Progress that reads in a log: when stderr is not a terminal (a log file, a pipe, a notebook's captured
output), a step bar redrawn in place would show only at the end, or as one endless line. There, the bars
print a plain line every `LOG_PERIOD_S` seconds instead, and one when they finish."""

from __future__ import annotations

import sys

LOG_PERIOD_S = 30.0  # seconds between two lines of a bar in a log


def to_terminal(stream=None) -> bool:
    """Whether `stream` (default: stderr) is a terminal, where bars redraw in place."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class LineStream:
    """A file for tqdm that turns each redraw (tqdm writes "\\r" and the bar) into a line of its own, so that a log
    shows each printed state of the bar on its own line."""

    def __init__(self, stream=None):
        self.stream = stream

    def write(self, text: str) -> int:
        stream = self.stream if self.stream is not None else sys.stderr
        line = text.replace("\r", "").rstrip()
        if line.strip():
            stream.write(line + "\n")
            stream.flush()
        return len(text)

    def flush(self) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.flush()


def tqdm_options(stream=None) -> dict:
    """Options of a tqdm bar (a diffusers pipeline's `set_progress_bar_config`) for `stream` (default: stderr):
    none on a terminal; elsewhere a line at most every `LOG_PERIOD_S` seconds, in ASCII, and one at the end."""
    if to_terminal(stream):
        return {}
    return {"file": LineStream(stream), "mininterval": LOG_PERIOD_S, "maxinterval": LOG_PERIOD_S, "ascii": True,
            "ncols": 80}


def log_progress(pipe, stream=None) -> None:
    """A diffusers pipeline's step bar made to print lines in a log (`tqdm_options`); on a terminal, unchanged."""
    options = tqdm_options(stream)
    if options:
        pipe.set_progress_bar_config(**{**dict(getattr(pipe, "_progress_bar_config", {})), **options})
