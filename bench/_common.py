"""Record format shared with ../shared/bench (imported from there when present)."""
from __future__ import annotations

import os
import sys

# ../shared/bench beside the repo; from a worktree (/work/wt/NAME) it is one level further up.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _up in (("..", ".."), ("..", "..", "..")):
    SHARED = os.path.abspath(os.path.join(_HERE, *_up, "shared", "bench"))
    if os.path.isdir(SHARED):
        sys.path.insert(0, SHARED)
        break
import common  # noqa: E402  (../shared/bench/common.py: constants, emit, percentiles)

common.SYSTEM = "monarch-kernel"

__all__ = ["common", "SHARED"]
