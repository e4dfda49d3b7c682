"""Record format shared with ../shared/bench (imported from there when present)."""
from __future__ import annotations

import os
import sys

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench"))
if os.path.isdir(SHARED):
    sys.path.insert(0, SHARED)
import common  # noqa: E402  (../shared/bench/common.py: constants, emit, percentiles)

common.SYSTEM = "monarch-kernel"

__all__ = ["common", "SHARED"]
