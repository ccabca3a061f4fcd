#!/usr/bin/env bash
# dsopt's two commands. Each one sets everything up on a fresh machine with Python 3 and pip:
#   bash dev.sh demo   # the main job
#   bash dev.sh test   # lint + the whole test suite (what CI runs, via .ci/run)
#   bash dev.sh services  # start PostgreSQL + a one-node SLURM on loopback for the cluster tests (root, Debian)
# The virtual environment lives in .venv (override with DSOPT_VENV=path).
# torch: on a machine without an NVIDIA GPU we install the CPU build first, so that the
# dependency "torch" does not pull a multi-GB CUDA build; override with DSOPT_TORCH="torch==X".
set -euo pipefail
cd "$(dirname "$0")"
venv="${DSOPT_VENV:-.venv}"
py="$venv/bin/python"

setup() {
  [ -x "$py" ] || python3 -m venv "$venv"
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    local spec="${DSOPT_TORCH:-}"
    if [ -z "$spec" ]; then
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then spec="torch"; else spec="torch==2.13.0"; fi
    fi
    "$py" -m pip install --quiet --disable-pip-version-check "$spec"
  fi
  "$py" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
}

case "${1:-}" in
  demo)
    setup
    "$venv/bin/dsopt" demo
    ;;
  test)
    setup
    "$venv/bin/ruff" check optimizer launchers tests benchmarks examples
    "$venv/bin/lint-imports"   # the layers contract in pyproject.toml
    # two workers (pytest-xdist), each taking whole test files: a module's shared fixtures (a study, a real run)
    # are made once, and the CPU a launch leaves idle (its imports, rendezvous, one rank waiting on the other) is
    # used by the other worker; the slowest 25 printed. A worker that crashes ends the run at once, failed: a
    # replaced worker under --dist loadfile can leave the run waiting for ever (pytest-xdist issue #1378)
    "$py" -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=25
    ;;
  services)
    bash .ci/services
    ;;
  *)
    echo "usage: bash dev.sh demo | test | services" >&2
    exit 2
    ;;
esac
