#!/usr/bin/env bash
# One prepared GPU check: run on a machine with one GPU and paste the tables into README.md and docs/LOG.md.
#   bash scripts/gpu_check.sh            # GPU: under 8 minutes on one H100/H200
#   bash scripts/gpu_check.sh --dry-run  # CPU, tiny shapes: shows the check runs end to end
# Sections are independent; each prints its own table and the script's exit code is 1 if any failed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
status=0

# ---- section: scale (training with compile, memory vs scripts/plan_memory.py per AC mode, float8) ----
echo "## gpu_check: scale"
python scripts/gpu_check_memory.py "$@" || status=1

exit $status
