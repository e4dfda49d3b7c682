"""TextSink: the part of a text stream that every stand-in for stdout on a proc shares."""
from __future__ import annotations

import io


class TextSink(io.TextIOBase):
    """A writable, non-tty, UTF-8 text stream; subclasses define ``write`` (and ``flush``)."""

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def isatty(self):
        return False
