"""Named dimensions: Extent, Point and MeshView (a selection of ranks laid out by dims).

A view is kept as an explicit tuple of underlying ranks in row-major order of its dims;
meshes here are at most a few thousand members, so plain tuples beat strided arithmetic
for clarity. Every bad selection raises a ValueError that names the dim, the valid range
and how to fix it.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping


class Extent(Mapping):
    """Ordered dimension sizes, e.g. ``Extent(("hosts", "gpus"), (2, 4))``."""

    __slots__ = ("labels", "sizes")

    def __init__(self, labels, sizes):
        self.labels = tuple(labels)
        self.sizes = tuple(int(s) for s in sizes)
        if len(self.labels) != len(self.sizes):
            raise ValueError(f"{len(self.labels)} labels but {len(self.sizes)} sizes")

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self):
        return iter(self.labels)

    def __len__(self):
        return len(self.labels)

    @property
    def nelements(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def __eq__(self, other):
        return isinstance(other, Extent) and (self.labels, self.sizes) == (other.labels, other.sizes)

    def __hash__(self):
        return hash((self.labels, self.sizes))

    def __repr__(self):
        return f"Extent({dict(zip(self.labels, self.sizes))})"

    def __reduce__(self):
        return (Extent, (self.labels, self.sizes))


class Point(Mapping):
    """A member's position: ``rank`` (row-major index in the extent) and named coords."""

    __slots__ = ("rank", "extent")

    def __init__(self, rank: int, extent: Extent):
        self.rank = int(rank)
        self.extent = extent

    @property
    def coords(self) -> dict:
        out, r = {}, self.rank
        for label, size in reversed(list(zip(self.extent.labels, self.extent.sizes))):
            out[label] = r % size
            r //= size
        return {k: out[k] for k in self.extent.labels}

    def __getitem__(self, label):
        return self.coords[label]

    def __iter__(self):
        return iter(self.extent.labels)

    def __len__(self):
        return len(self.extent.labels)

    def __eq__(self, other):
        return isinstance(other, Point) and (self.rank, self.extent) == (other.rank, other.extent)

    def __hash__(self):
        return hash((self.rank, self.extent))

    def __index__(self):
        return self.rank

    def __int__(self):
        return self.rank

    def __repr__(self):
        inner = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"Point(rank={self.rank}, {inner})" if inner else f"Point(rank={self.rank})"

    def __reduce__(self):
        return (Point, (self.rank, self.extent))


class MeshView:
    """Dims (labels, sizes) over a tuple of underlying ranks, row-major."""

    __slots__ = ("labels", "sizes", "ranks", "_extent")

    def __init__(self, labels, sizes, ranks=None):
        self.labels = tuple(labels)
        self.sizes = tuple(int(s) for s in sizes)
        n = 1
        for s in self.sizes:
            n *= s
        self.ranks = tuple(range(n)) if ranks is None else tuple(ranks)
        if len(self.ranks) != n:
            raise ValueError(f"{n} members expected for sizes {self.sizes}, got {len(self.ranks)}")

    @property
    def extent(self) -> Extent:
        try:
            return self._extent   # made once: every call of an endpoint asks for it
        except AttributeError:
            self._extent = e = Extent(self.labels, self.sizes)
            return e

    def __len__(self):
        return len(self.ranks)

    def __eq__(self, other):
        return isinstance(other, MeshView) and (self.labels, self.sizes, self.ranks) == (
            other.labels, other.sizes, other.ranks)

    def __reduce__(self):
        return (MeshView, (self.labels, self.sizes, self.ranks))

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in zip(self.labels, self.sizes)) or "a single member"

    def size(self, dim: str) -> int:
        self._check_dim(dim)
        return self.sizes[self.labels.index(dim)]

    def _check_dim(self, dim: str):
        if dim not in self.labels:
            have = ", ".join(self.labels) or "none (the mesh is a single member)"
            raise ValueError(f"unknown dimension {dim!r}: this mesh's dimensions are {have}")

    def slice(self, **selection) -> MeshView:
        """``int`` picks one index and drops the dim; ``slice`` keeps a range of it."""
        picks = []
        for label, size in zip(self.labels, self.sizes):
            sel = selection.get(label, slice(None))
            if isinstance(sel, bool) or not isinstance(sel, (int, slice, range)):
                raise TypeError(f"{label}={sel!r}: select with an int or a slice (e.g. {label}=slice(0, 2))")
            if isinstance(sel, int):
                if not -size <= sel < size:
                    raise ValueError(f"{label}={sel} is out of range: {label} has size {size} "
                                     f"(valid indices 0..{size - 1})")
                picks.append((label, [sel % size], True))
            else:
                if isinstance(sel, range):
                    sel = slice(sel.start, sel.stop, sel.step)
                if sel.start is not None and not -size <= sel.start < size:
                    raise ValueError(f"{label}={_fmt_slice(sel)} starts out of range: {label} has size "
                                     f"{size} (valid indices 0..{size - 1})")
                idx = list(range(size))[sel]
                if not idx:
                    raise ValueError(f"{label}={_fmt_slice(sel)} selects no members of {label} (size {size})")
                picks.append((label, idx, False))
        for label in selection:
            self._check_dim(label)
        index_of = {}
        for flat, coord in enumerate(itertools.product(*[range(s) for s in self.sizes])):
            index_of[coord] = flat
        ranks = [self.ranks[index_of[c]] for c in itertools.product(*[p[1] for p in picks])]
        kept = [(label, len(idx)) for label, idx, drop in picks if not drop]
        return MeshView([k for k, _ in kept], [s for _, s in kept], ranks)

    def flatten(self, name: str) -> MeshView:
        return MeshView((name,), (len(self.ranks),), self.ranks)

    def rename(self, **mapping) -> MeshView:
        for old in mapping:
            self._check_dim(old)
        return MeshView([mapping.get(k, k) for k in self.labels], self.sizes, self.ranks)

    def points(self) -> Iterator[Point]:
        ext = self.extent
        return (Point(i, ext) for i in range(len(self.ranks)))


def _fmt_slice(s: slice) -> str:
    parts = ["" if s.start is None else str(s.start), "" if s.stop is None else str(s.stop)]
    if s.step is not None:
        parts.append(str(s.step))
    return ":".join(parts)


_RANGE = re.compile(r"^\s*(-?\d*)\s*:\s*(-?\d*)\s*(?::\s*(-?\d*)\s*)?$")
_SPAN = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")   # first-last, both in: what our output prints


def _parse_index(text: str, what: str):
    text = text.strip()
    m = _RANGE.match(text)
    if m:
        a, b, c = (int(x) if x else None for x in m.groups())
        return slice(a, b, c)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    m = _SPAN.match(text)
    if m:
        first, last = int(m.group(1)), int(m.group(2))
        if last < first:
            raise ValueError(f"malformed rank spec {what!r}: {text!r} runs backwards; write {last}-{first}")
        return range(first, last + 1)   # a range, not a slice: its end is checked, not cut
    raise ValueError(f"malformed rank spec {what!r}: {text!r} is neither an index, first-last (both "
                     "included, as the output prints ranks) nor start:stop[:step]")


def parse_rank_spec(spec: str, view: MeshView) -> MeshView:
    """Monarch's rank grammar over a view: ``3``, ``1,4,6``, ``0:8:2``, ``gpus=1:3``,
    ``hosts=0,gpus=1:3``; optionally wrapped as ``ranks(...)``. Also ``first-last`` (both
    included: ``0-3,8``), the form the notebook prints ranks in (``[ranks 0-3,8]``), so a
    user can paste what they read.

    Plain indices and ranges address the flattened mesh and yield a one-dim view named
    ``ranks``; ``dim=...`` terms slice by name and keep the other dims.
    """
    text = spec.strip()
    m = re.fullmatch(r"ranks\((.*)\)", text)
    if m:
        text = m.group(1)
    if not text:
        raise ValueError("empty rank spec: give an index (3), a list (1,4,6), a range (0:8:2 or 0-7) or "
                         "dim=range")
    if "=" in text:
        sizes = dict(zip(view.labels, view.sizes))
        selection = {}
        for term in text.split(","):
            if "=" not in term:
                raise ValueError(f"malformed rank spec {spec!r}: mix of named ({text}) and plain terms")
            k, v = term.split("=", 1)
            label = k.strip()
            sel = selection[label] = _parse_index(v, spec)
            if isinstance(sel, range) and label in sizes and sel[-1] >= sizes[label]:
                raise ValueError(f"{term.strip()} ends out of range: {label} has size {sizes[label]} "
                                 f"(valid indices 0..{sizes[label] - 1})")
        return view.slice(**selection)
    flat = view.flatten("ranks")
    n = len(flat)
    chosen: list[int] = []
    for term in text.split(","):
        sel = _parse_index(term, spec)
        if isinstance(sel, int):
            if not -n <= sel < n:
                raise ValueError(f"rank {sel} is outside the mesh: valid ranks are 0..{n - 1}")
            chosen.append(sel % n)
        elif isinstance(sel, range) and sel[-1] >= n:
            raise ValueError(f"ranks {term.strip()} end outside the mesh: valid ranks are 0..{n - 1}")
        else:
            idx = list(sel) if isinstance(sel, range) else list(range(n))[sel]
            if not idx:
                raise ValueError(f"rank range {term.strip()!r} selects nothing: valid ranks are 0..{n - 1}")
            chosen.extend(idx)
    chosen = sorted(set(chosen))
    return MeshView(("ranks",), (len(chosen),), [flat.ranks[i] for i in chosen])
