"""Everything a command prints goes through the redactor (plans/redaction.py): its result, its
error line, RAYSHARD_DEBUG=1's traceback, progress bars, warnings, log lines and the Ray logs the
driver relays, and the traceback of an error that ends the process. One wrapper around stdout and
stderr rather than a call at each print, so output added later is covered too (decision 101)."""
from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import traceback

from rayshard.plans.redaction import Redactor


class RedactingStream(io.TextIOBase):
    """A text stream that redacts each line before passing it on. Text is held until a line ends
    ('\\n', or the '\\r' a progress bar redraws with) or a flush, so a secret written in two
    pieces is still seen whole."""

    def __init__(self, stream, redactor: Redactor):
        self.stream, self.redactor, self._pending = stream, redactor, ""
        self._lock = threading.Lock()  # Ray relays worker logs from a thread of its own

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            cut = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
            if cut >= 0:
                ready, self._pending = self._pending[:cut + 1], self._pending[cut + 1:]
                self.stream.write(self.redactor.redact(ready))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                text, self._pending = self._pending, ""
                self.stream.write(self.redactor.redact(text))
        self.stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:  # progress bars draw only on a terminal
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name):  # encoding, errors, buffer...: the wrapped stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def redacted_output(argv: list[str]):
    """stdout and stderr redacted while the command runs; an exception that leaves `main` is
    printed redacted by the interpreter's hook."""
    redactor = Redactor.for_process(os.environ, argv)
    _hook_uncaught_errors(redactor)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(sys.stdout, redactor), RedactingStream(sys.stderr, redactor)
    try:
        yield redactor
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a reader that left (`| head`)
                stream.flush()
        sys.stdout, sys.stderr = saved


_HOOKED: dict[str, Redactor] = {}  # the redactor of the latest command, for the one hook installed


def _hook_uncaught_errors(redactor: Redactor) -> None:
    first = not _HOOKED
    _HOOKED["redactor"] = redactor
    if not first:
        return
    previous = sys.excepthook

    def print_redacted(kind, error, trace):
        if issubclass(kind, (KeyboardInterrupt, SystemExit)):
            return previous(kind, error, trace)
        sys.stderr.write(_HOOKED["redactor"].redact("".join(traceback.format_exception(kind, error, trace))))
        sys.stderr.flush()

    sys.excepthook = print_redacted
