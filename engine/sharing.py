"""One batch checked by several compositions and properties (search/group.py): what is made of it, made once.

While ``sharing()`` is on, a ``LastMade`` keeps the value it last made and hands it out again for the same key; when
the outermost ``sharing()`` ends, every one forgets. Off, it makes the value every time.
"""

from __future__ import annotations

from contextlib import contextmanager

_depth = 0
_memos: list["LastMade"] = []


def active() -> bool:
    return _depth > 0


@contextmanager
def sharing():
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            for memo in _memos:
                memo.last = None


class LastMade:
    """The value made last, for the one batch being checked (a key: its spec and device)."""

    def __init__(self) -> None:
        self.last: tuple | None = None  # (key, value)
        _memos.append(self)

    def get(self, key, make):
        if not _depth:
            return make()
        if self.last is None or self.last[0] != key:
            self.last = (key, make())
        return self.last[1]
