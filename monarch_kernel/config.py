"""Every ``MONARCH_KERNEL_*`` environment variable: its type, default, meaning, who reads it.

    from monarch_kernel import config
    cap = config.MAX_PROCS.get()        # int; the default when unset (or set to "")

Values are read when used, never frozen at import: a test or a notebook that sets a
variable sees it at the next use, and a process started later (an agent, its zygote and
procs) reads its own environment, inherited at its start. A bad value raises
``ConfigError`` (a ``ValueError``) that names the variable, the value, what is expected and
the default, e.g. ``MONARCH_KERNEL_MAX_PROCS='abc' is not an integer``.

``python -m monarch_kernel.config`` prints the README's table of variables (``--update
README.md`` writes it there);
tests/test_config.py checks that the README holds exactly that table and that every
``MONARCH_KERNEL_*`` name the tree mentions is declared here. To add a variable: declare
it below (in its group) and run ``python -m monarch_kernel.config --update README.md``.

Imports only the standard library, so the core and every process may import it.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

PREFIX = "MONARCH_KERNEL_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "a boolean (1/0, true/false, yes/no, on/off)",
               "str": "a string", "path": "a path", "hex": "a hex string", "choice": "one of",
               "modules": "module names, comma-separated (e.g. numpy,matplotlib.pyplot)"}
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


def module_names(names) -> list[str]:
    """Dotted module names (a comma-separated string, or a list), each checked: a ValueError
    names one that is not a module's name (a preload imports them: no path, no code)."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = []
    for n in items:
        n = n.strip() if isinstance(n, str) else n
        if n == "" and isinstance(names, str):
            continue
        if not isinstance(n, str) or not _MODULE.match(n):
            raise ValueError(f"{n!r} is not a module name: give dotted Python names, e.g. numpy,matplotlib.pyplot")
        out.append(n)
    return out


_ENVIRON = getattr(os.environ, "_data", None)   # what os.environ reads: bytes -> bytes (POSIX)
_UNREAD = object()
_SEEN: dict[str, list] = {}   # setting name -> [its key in _ENVIRON, the text's object last read, its value]


class ConfigError(ValueError):
    """A ``MONARCH_KERNEL_*`` variable holds a value that cannot be used."""


@dataclass(frozen=True)
class Setting:
    """One environment variable. ``read_by`` says which process reads it: kernel (the
    notebook's process), controller (any process driving a mesh: kernel or script),
    agent, proc, any, internal (set by us for a child process), tests (the test suite)."""

    name: str            # without the prefix
    kind: str            # int | float | bool | str | path | hex | choice
    default: object
    meaning: str
    read_by: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None

    @property
    def env(self) -> str:
        return PREFIX + self.name

    def raw(self) -> str | None:
        """The variable's text, or None when it is unset or empty."""
        value = os.environ.get(self.env)
        return None if value is None or not value.strip() else value.strip()

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self):
        """The value now: read from the environment at each call (a user or a test may change
        it), parsed again only when the variable's text changed. Some are read on every call to
        many members (core/fanout.py: FANOUT_MIN), where os.environ's Python layers and the parse
        cost ~2 µs. A path is always worked out again (its default follows HOME)."""
        if _ENVIRON is None or self.kind == "path":
            return self._read()
        seen = _SEEN.get(self.name)
        if seen is None:
            seen = _SEEN[self.name] = [os.fsencode(self.env), _UNREAD, None]
        text = _ENVIRON.get(seen[0])
        if text is not seen[1]:   # (setting it again, even to the same text, stores a new object)
            seen[2] = self._read()   # (a bad value raises here, every time, and is not kept)
            seen[1] = text
        return seen[2]

    def _read(self):
        raw = self.raw()
        if raw is None:
            return os.path.expanduser(self.default) if self.kind == "path" and self.default else self.default
        return self.parse(raw)

    def parse(self, raw: str):
        if self.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                try:
                    as_float = float(raw)
                except ValueError:
                    as_float = math.nan
                if not (math.isfinite(as_float) and as_float.is_integer()):
                    raise self.error(raw, "is not an integer") from None
                value = int(as_float)
        elif self.kind == "float":
            try:
                value = float(raw)
            except ValueError:
                raise self.error(raw, "is not a number") from None
            if math.isnan(value):
                raise self.error(raw, "is not a number")
        elif self.kind == "bool":
            low = raw.lower()
            if low not in _TRUE + _FALSE:
                raise self.error(raw, "is not a boolean")
            return low in _TRUE
        elif self.kind == "choice":
            value = raw.lower()
            if value not in self.choices:
                raise self.error(raw, "is not " + " or ".join(repr(c) for c in self.choices))
            return value
        elif self.kind == "hex":
            try:
                bytes.fromhex(raw)
            except ValueError:
                raise self.error(raw, "is not a hex string") from None
            return raw
        elif self.kind == "path":
            return os.path.expanduser(raw)
        elif self.kind == "modules":
            names = tuple(n.strip() for n in raw.split(",") if n.strip())
            bad = [n for n in names if not _MODULE.match(n)]
            if bad:
                raise self.error(raw, f"names {bad[0]!r}, not a module")
            return names
        else:
            return raw
        if self.minimum is not None and value < self.minimum:
            raise self.error(raw, f"is below {self.minimum:g}")
        return value

    def error(self, raw: str, why: str) -> ConfigError:
        expected = _KIND_WORDS[self.kind]
        if self.kind == "choice":
            expected += " " + ", ".join(self.choices)
        if self.minimum is not None:
            expected += f", at least {self.minimum:g}"
        shown = raw if len(raw) <= 60 else raw[:57] + "..."
        return ConfigError(f"{self.env}={shown!r} {why}: expected {expected}. Unset it for the default "
                           f"({self.default_text()}), or fix the value ({self.meaning}).")

    def default_text(self) -> str:
        if self.default is None or self.default == ():
            return "unset"
        if self.kind == "bool":
            return "1" if self.default else "0"
        if self.kind == "int" and isinstance(self.default, int) and self.default >= 1 << 20 \
                and self.default % (1 << 20) == 0:
            return f"{self.default} ({self.default >> 20} MiB)"
        return str(self.default)


SETTINGS: dict[str, Setting] = {}


def _declare(name, kind, default, meaning, read_by, **kw) -> Setting:
    if name in SETTINGS:
        raise ValueError(f"{PREFIX}{name} is declared twice in monarch_kernel/config.py")
    s = SETTINGS[name] = Setting(name, kind, default, meaning, read_by, **kw)
    return s


# ------------------------------------------------------------------- where things live
HOME = _declare("HOME", "path", "~/.monarch_kernel", "where mesh connection files, logs and synced "
                "workspaces live", "any")
KEY = _declare("KEY", "hex", None, "the mesh key (hex) for an agent started by hand and for "
               "`attach_to_workers` without `key=`; an agent removes it from its environment", "any")
BIND = _declare("BIND", "str", None, "the address to listen on and advertise for multi-host meshes "
                "(default: loopback on one host, or the address that routes to the cluster)", "any")
ADVERTISE = _declare("ADVERTISE", "str", None, "the address an agent bound to 0.0.0.0 tells peers "
                     "(`POD_IP` wins; default: the address of the default route)", "agent")
SYNC_DIR = _declare("SYNC_DIR", "path", None, "where a host keeps synced code (default "
                    "`$MONARCH_KERNEL_HOME/workspaces/<agent>-<host>`)", "agent")

# ------------------------------------------------------------------- the notebook
PREWARM = _declare("PREWARM", "bool", True, "the kernel starts (or attaches to) the notebook's default "
                   "mesh agent at kernel start", "kernel")
DEFAULT_MESH = _declare("DEFAULT_MESH", "str", "default", "the name of the notebook's default mesh", "kernel")
HOLD_S = _declare("HOLD_S", "float", 1.0, "seconds a cell's output is held (and merged across ranks) "
                  "before it goes live", "kernel", minimum=0)
MERGE_WINDOW_S = _declare("MERGE_WINDOW_S", "float", 0.25, "seconds over which live identical lines "
                          "from several ranks are merged", "kernel", minimum=0)
OUTPUT_RATE = _declare("OUTPUT_RATE", "float", 200.0, "most lines a second written to the notebook "
                       "(the rest: in the ranks' logs)", "kernel", minimum=0)
OUTPUT_BURST = _declare("OUTPUT_BURST", "int", 1000, "lines the notebook takes at once before "
                        "OUTPUT_RATE applies", "kernel", minimum=0)
OUTPUT_LINES = _declare("OUTPUT_LINES", "int", 10_000, "most lines one cell writes to the notebook",
                        "kernel", minimum=0)
OUTPUT_HELD = _declare("OUTPUT_HELD", "int", 50_000, "most lines held in memory while merging", "kernel",
                       minimum=0)
PROGRESS_RANKS = _declare("PROGRESS_RANKS", "int", 8, "a cell on at least this many ranks shows a "
                          "progress line and a summary", "kernel", minimum=1)

# ------------------------------------------------------------------- controller and runtime
HEARTBEAT_S = _declare("HEARTBEAT_S", "float", 0.5, "seconds between heartbeats of controller and agents",
                       "any", minimum=0.01)
HOST_TIMEOUT_S = _declare("HOST_TIMEOUT_S", "float", 3.0, "seconds of silence after which a host is "
                          "declared lost", "any", minimum=0.1)
STARVED_HOST_TIMEOUT_S = _declare("STARVED_HOST_TIMEOUT_S", "float", 30.0, "the same for an agent on "
                                  "this machine that the scheduler shows running or waiting for a CPU",
                                  "controller", minimum=0.1)
LEASE_S = _declare("LEASE_S", "float", 3600.0, "seconds a persistent mesh lives without a controller",
                   "any", minimum=0)
SAME_HOST_IPC = _declare("SAME_HOST_IPC", "bool", True, "processes on one host talk over ipc sockets "
                         "(0: tcp on loopback)", "any")
CURVE = _declare("CURVE", "choice", "auto", "CurveZMQ on tcp links: `auto` (every tcp endpoint, loopback "
                 "too: a stranger fails the handshake), `remote` (only those that leave loopback), `always` "
                 "(= auto), `never`", "any", choices=("auto", "remote", "always", "never"))
IPC_DIR = _declare("IPC_DIR", "path", None, "where this user's same-host ipc sockets live (made 0700; "
                   "default `/tmp/monarch-kernel-<uid>`)", "any")
MAX_MESSAGE_AGE_S = _declare("MAX_MESSAGE_AGE_S", "float", 300.0, "older signed messages are refused as "
                             "replays (clock skew plus queueing)", "any", minimum=1)
SHM_TENSORS = _declare("SHM_TENSORS", "bool", True, "large tensors between processes of one host go "
                       "through shared memory", "any")
SHM_TENSOR_BYTES = _declare("SHM_TENSOR_BYTES", "int", 1 << 20, "tensors at least this large go "
                            "through shared memory", "any", minimum=0)

# ------------------------------------------------------------------- fan-out and fan-in
FANOUT_MIN = _declare("FANOUT_MIN", "int", 32, "members in one call, spawn or broadcast before it goes "
                      "through their hosts' agents, one send a host (0: fan-out off)", "controller", minimum=0)
FANOUT_TREE_WIDTH = _declare("FANOUT_TREE_WIDTH", "int", 16, "most host agents one sender (the controller, "
                              "or an agent of the tree) forwards a fanned message to: past that many hosts, "
                              "hosts form a tree (0: no tree)", "controller", minimum=0)
FANIN_FLUSH_S = _declare("FANIN_FLUSH_S", "float", 0.002, "seconds an agent holds its procs' replies and "
                         "output before sending a batch that is not complete", "agent", minimum=0)
FAN_LINK = _declare("FAN_LINK", "bool", True, "an agent and its procs carry fanned calls, their replies "
                    "and output over a raw local socket (node/fanlink.py) instead of zmq", "agent")

# ------------------------------------------------------------------- host agent and procs
HOST_NAME = _declare("HOST_NAME", "str", None, "the name an agent gives its host in ranks' tables, errors and "
                     "telemetry (default: the machine's hostname; the hosts of `%mesh connect --hosts N` are "
                     "named `<hostname>/hosts<i>`)", "agent")
MAX_PROCS = _declare("MAX_PROCS", "int", 0, "most procs one agent runs (0: 8 per core, at least 256)",
                     "agent", minimum=0)
PROC_MEM_MB = _declare("PROC_MEM_MB", "float", 40.0, "memory (MB) a new proc is assumed to need when an "
                       "agent checks room for a spawn (one forked from the zygote starts at ~7 MB of its own)",
                       "agent", minimum=0)
AGENT_MAX_MESSAGE = _declare("AGENT_MAX_MESSAGE", "int", 4 << 20, "largest frame an agent reads before any "
                             "MAC check (bytes, + 4 KiB; at least 4 MiB: larger messages travel in 4 MiB "
                             "pieces)", "agent", minimum=1024)
TELEMETRY_S = _declare("TELEMETRY_S", "float", 1.0, "seconds between an agent's telemetry samples "
                       "(0: off)", "agent", minimum=0)
TELEMETRY_HISTORY_S = _declare("TELEMETRY_HISTORY_S", "float", 3600.0, "seconds of samples an agent "
                               "keeps", "agent", minimum=0)
LOG_MB = _declare("LOG_MB", "float", 16.0, "size at which a proc's log file rotates (MB)", "agent",
                  minimum=0.001)
PROC_OUTPUT_RATE = _declare("PROC_OUTPUT_RATE", "float", 50.0, "most lines a second a proc sends "
                            "after its burst (0: no limit); the rest only in its log", "proc", minimum=0)
PROC_OUTPUT_BURST = _declare("PROC_OUTPUT_BURST", "float", 500.0, "lines a proc sends at once before "
                             "PROC_OUTPUT_RATE applies", "proc", minimum=0)
OUTPUT_BATCH_MS = _declare("OUTPUT_BATCH_MS", "float", 20.0, "lines a proc prints within this many "
                           "ms of the last ones sent go together, in one message (0: a message a line)",
                           "proc", minimum=0)
OUTPUT_LINE_CHARS = _declare("OUTPUT_LINE_CHARS", "int", 10000, "characters of a printed line a proc "
                             "sends; the rest only in its log (0: whole lines)", "proc", minimum=0)
KEEP_CUDA_VISIBLE = _declare("KEEP_CUDA_VISIBLE", "bool", False, "procs keep the inherited "
                             "`CUDA_VISIBLE_DEVICES` instead of one GPU each", "proc")
NO_TORCH = _declare("NO_TORCH", "bool", False, "the zygote does not import torch before forking procs",
                    "agent")
PRELOAD = _declare("PRELOAD", "modules", (), "modules (comma-separated) each host's zygote imports "
                   "before forking procs, so ranks start with them loaded (`HostMesh.preload`, `%mesh "
                   "connect --preload` add more later; `%mesh connect` asks for them too)", "any")
ZYGOTE_HUGE_PAGES = _declare("ZYGOTE_HUGE_PAGES", "bool", True, "the zygote collapses its memory into 2 MB "
                             "pages (Linux 6.1+), so each fork copies ~5x less page table", "agent")

# ------------------------------------------------------------------- code sync
SYNC_MAX_BYTES = _declare("SYNC_MAX_BYTES", "int", 1 << 30, "most bytes `%mesh sync` sends (`--max-size` "
                          "overrides)", "controller", minimum=0)
SYNC_ENV_MAX_BYTES = _declare("SYNC_ENV_MAX_BYTES", "int", 10 << 30, "the same for `%mesh sync --env`",
                              "controller", minimum=0)
SYNC_COMPRESS = _declare("SYNC_COMPRESS", "choice", "auto", "compress synced files: `auto` (not to an "
                         "agent on loopback), `always`, `never`", "controller", choices=("auto", "always", "never"))

# ------------------------------------------------------------------- RDMA buffers
RDMA_BACKEND = _declare("RDMA_BACKEND", "str", "auto", "the RDMABuffer transport: auto, shm, tcp, cuda_ipc or "
                        "ibverbs", "any")
VERBS_LAYER = _declare("VERBS_LAYER", "str", None, "`module:Class` of the verbs layer (default: pyverbs)",
                       "any")
PIN_TTL_S = _declare("PIN_TTL_S", "float", 300.0, "seconds a sender keeps a buffer pinned for a wire "
                     "transfer", "any", minimum=0)
RECV_POOL_BYTES = _declare("RECV_POOL_BYTES", "int", 512 << 20, "bytes of receive buffers a process "
                           "keeps for wire transfers", "any", minimum=0)
FAKE_VERBS_DIR = _declare("FAKE_VERBS_DIR", "path", None, "the fake verbs fabric's folder (tests; "
                          "default: the temp dir)", "any")

# ------------------------------------------------------------------- set by us for a child
AGENT_PID = _declare("AGENT_PID", "int", 0, "the agent's pid, for its zygote (dies with it)", "internal",
                     minimum=0)
PROC = _declare("PROC", "str", None, "a proc's own key, set in each proc", "internal")
SET_IFNAME = _declare("SET_IFNAME", "bool", False, "a proc chose `GLOO_SOCKET_IFNAME` itself (and may "
                      "change it)", "internal")

# ------------------------------------------------------------------- the test suite
SCREENSHOTS = _declare("SCREENSHOTS", "path", None, "where browser tests save screenshots (default: a "
                       "temp dir, removed when the run passes)", "tests")
SOAK_S = _declare("SOAK_S", "float", 30.0, "seconds the reliability soak test runs", "tests", minimum=0)
SOAK_SEED = _declare("SOAK_SEED", "int", 9, "the soak test's random seed", "tests")


def problems(*read_by: str) -> list[str]:
    """The errors of every set variable read by these processes (all when none is named):
    a process checks its own at start, so a bad value stops it with the variable's name
    rather than later, halfway through."""
    bad = []
    for s in SETTINGS.values():
        if read_by and s.read_by not in read_by:
            continue
        try:
            s.get()
        except ConfigError as e:
            bad.append(str(e))
    return bad


def markdown_table() -> str:
    """The README's table of variables (``python -m monarch_kernel.config`` prints it)."""
    rows = ["| Variable | Type | Default | Read by | Meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        kind = "/".join(s.choices) if s.kind == "choice" else s.kind
        rows.append(f"| `{s.env}` | {kind} | {s.default_text()} | {s.read_by} | {s.meaning} |")
    return "\n".join(rows) + "\n"


def update_readme(path: str) -> bool:
    """Put the current table between the README's ``config-table`` markers; True if it changed."""
    import re

    with open(path, encoding="utf-8") as f:
        text = f.read()
    new, n = re.subn(r"(<!-- config-table[^>]*-->\n).*?(<!-- /config-table -->)",
                     lambda m: m.group(1) + markdown_table() + m.group(2), text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{path}: no <!-- config-table --> ... <!-- /config-table --> section")
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":   # python -m monarch_kernel.config [--update README.md]
    if sys.argv[1:2] == ["--update"]:
        print("updated" if update_readme(sys.argv[2] if len(sys.argv) > 2 else "README.md") else "up to date")
    else:
        sys.stdout.write(markdown_table())
