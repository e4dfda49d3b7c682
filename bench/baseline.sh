#!/usr/bin/env bash
# Run ../shared/bench/baseline_zmq.py (arguments passed through) from a separate venv prefix
# that reuses .venv's packages. The baseline ends by killing every process whose command line
# names its interpreter's prefix; a prefix of its own keeps it off our tests and meshes.
set -euo pipefail
cd "$(dirname "$0")/.."
BV=.bench-venv
if [ ! -x "$BV/bin/python" ]; then
  python3 -m venv "$BV"
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$BV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$own/_use_project_venv.pth"
fi
SHARED=../shared/bench
[ -d "$SHARED" ] || SHARED=../../shared/bench   # from a worktree (/work/wt/NAME)
exec "$BV/bin/python" "$SHARED/baseline_zmq.py" "$@"
