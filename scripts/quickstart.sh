#!/usr/bin/env bash
# Set up .venv, then run notebooks/quickstart.ipynb end to end in the Monarch kernel
# (a local mesh of 4 procs: %mesh connect, %%on_mesh, results, push/pull, stop) and print
# what each cell showed. The notebook file itself is left unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python - <<'PY'
import time

import nbformat
from nbclient import NotebookClient

nb = nbformat.read("notebooks/quickstart.ipynb", as_version=4)
t0 = time.perf_counter()
NotebookClient(nb, kernel_name="monarch", timeout=300, resources={"metadata": {"path": "notebooks"}}).execute()
took = time.perf_counter() - t0
cells = [c for c in nb.cells if c.cell_type == "code"]
for c in cells:
    print(f"In [{c.execution_count}]: " + c.source.replace("\n", "\n        "))
    for o in c.outputs:
        if o.output_type == "stream":
            print("  " + o.text.rstrip().replace("\n", "\n  "))
        elif o.output_type in ("execute_result", "display_data") and "application/vnd.jupyter.widget-view+json" not in o.data:
            print("  " + o.data.get("text/plain", "").replace("\n", "\n  "))
errors = sum(o.output_type == "error" for c in cells for o in c.outputs)
print(f"\nquickstart.ipynb: {len(cells)} cells ran in the monarch kernel in {took:.1f} s, {errors} errors")
raise SystemExit(1 if errors else 0)
PY
