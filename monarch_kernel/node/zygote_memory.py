"""The zygote's memory, shaped so that fork() is cheap and its children share more.

Why: fork() copies the parent's page tables. After torch is imported the zygote holds
~150 MB of anonymous memory (the malloc heap, Python's arenas), ~39,000 page-table entries
to copy and write-protect per fork: ~6 ms a fork on our 2-core VM, serial in the zygote,
1.5 s of a spawn of 256 procs. Collapsed into 2 MB pages (``MADV_COLLAPSE``, Linux 6.1+)
the same memory is ~65 entries, and a fork takes ~1.3 ms.

The zygote collapses only while none of its procs lives (zygote.py): a chunk a child
still shares would be copied into the new huge page and the child left the sole owner of
the old pages (memory counted twice). So the work happens while the zygote idles before its
first spawn, or before a big first batch of forks, or once its procs have all exited.

What it does not change: a child that writes into a shared huge page gets that 4 KB page
copied, as before (the kernel splits the shared 2 MB mapping first), so memory per proc
stays what it was; and no region is marked ``MADV_HUGEPAGE``, so memory a proc (or the
zygote) allocates later stays in 4 KB pages. Where the kernel cannot (older than 6.1,
THP disabled, no free 2 MB pages), forks cost what they did; nothing fails.

``gc.freeze()`` (``freeze_objects``) is the other half: a full garbage collection in a child
writes to the header of every object it tracks, which would copy most of the inherited heap
into the child; frozen objects are never visited.
"""
from __future__ import annotations

import ctypes
import errno
import gc

MADV_COLLAPSE = 25          # linux/mman.h, 6.1+
HUGE = 2 << 20              # x86_64 and aarch64 (4 KB base pages) PMD size
MIN_REGION = 4 << 20        # smaller regions hold few whole 2 MB pages


def freeze_objects() -> None:
    """Move every object the zygote has made into the permanent generation (see the module
    docstring): children's collections then never touch them."""
    gc.collect()
    gc.freeze()


class HugePages:
    """The zygote's anonymous memory, collapsed into 2 MB pages a chunk at a time, so the
    zygote can do it between forks (``step``) or at once before many (``finish``)."""

    def __init__(self, maps_path: str = "/proc/self/maps"):
        self.regions: list[list[int]] = []   # [next 2 MB chunk to collapse, end] per region, in order
        self.collapsed = 0                   # chunks now in huge pages
        self._madvise = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int
            with open(maps_path) as f:
                lines = [line.split() for line in f]
        except (OSError, AttributeError):
            return
        for parts in lines:
            path = parts[5] if len(parts) > 5 else ""
            if parts[1] != "rw-p" or path not in ("", "[heap]"):
                continue   # private writable anonymous memory only (not stacks, files, shared)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            first, end = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
            if hi - lo >= MIN_REGION and end > first:
                self.regions.append([first, end])
        self.regions.reverse()   # popped from the end: lowest address first

    @property
    def done(self) -> bool:
        return not self.regions

    def step(self) -> None:
        """Collapse one 2 MB chunk (a few ms). A region the kernel refuses (``EINVAL``: not
        eligible, or a kernel without ``MADV_COLLAPSE``) is dropped; no huge page to be had
        (``ENOMEM``, ``EAGAIN``) or not allowed ends the work: forks cost what they did."""
        if not self.regions:
            return
        region = self.regions[-1]
        addr = region[0]
        region[0] += HUGE
        if region[0] >= region[1]:
            self.regions.pop()
        if self._madvise(addr, HUGE, MADV_COLLAPSE) == 0:
            self.collapsed += 1
            return
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            if self.regions and self.regions[-1] is region:
                self.regions.pop()
            return
        if err not in (errno.EBUSY,):   # a page in flight (rare): skip just this chunk
            self.regions.clear()

    def finish(self) -> None:
        while self.regions:
            self.step()
