"""Install the ``monarch`` kernelspec: ``python -m monarch_kernel.install [--user|--sys-prefix|--prefix P]``.

The kernelspec runs this interpreter (an absolute path, so the kernel works when Jupyter
runs from another environment) with ``-m monarch_kernel``, and carries the logos the
launcher shows (``kernelspec_assets/``, drawn by scripts/make_logo.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Monarch (Python 3)"
ASSETS = Path(__file__).resolve().parent / "kernelspec_assets"
LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")


def kernel_json() -> dict:
    return {"argv": [sys.executable, "-m", "monarch_kernel", "-f", "{connection_file}"],
            "display_name": DISPLAY_NAME, "language": "python", "interrupt_mode": "signal",
            "metadata": {"debugger": True}}


def install(user: bool = False, prefix: str | None = None) -> str:
    """Write the kernelspec; returns where it went."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "kernel.json").write_text(json.dumps(kernel_json(), indent=1))
        for logo in LOGOS:
            shutil.copy(ASSETS / logo, Path(d) / logo)
        return KernelSpecManager().install_kernel_spec(d, KERNEL_NAME, user=user, prefix=prefix)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_kernel.install", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into ~/.local/share/jupyter")
    where.add_argument("--sys-prefix", action="store_true", help=f"into {sys.prefix} (this environment)")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter")
    a = p.parse_args(argv)
    prefix = sys.prefix if a.sys_prefix else a.prefix
    dest = install(user=a.user, prefix=prefix)
    print(f"installed kernelspec {KERNEL_NAME!r} ({DISPLAY_NAME}) in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
