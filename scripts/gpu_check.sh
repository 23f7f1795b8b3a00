#!/usr/bin/env bash
# One prepared GPU check: run on a machine with one GPU and paste the tables into README.md and docs/LOG.md.
#   bash scripts/gpu_check.sh            # GPU: about 11 minutes on one H100/H200, plus the decoding section
#                                        # (not yet run: its compiles take minutes the first time)
#   bash scripts/gpu_check.sh --dry-run  # CPU, tiny shapes: shows the check runs end to end (the GDP
#                                        # section under the Triton interpreter, fp32: it computes bf16 wrongly)
# Sections are independent; each prints its own table and the script's exit code is 1 if any failed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/outputs/inductor-cache}"
status=0

dry_run=false
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=true
elif ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check.sh: no CUDA device; use --dry-run to exercise the script on CPU" >&2
    exit 2
fi

# ---- section: Gated DeltaProduct (Triton vs the fp32 naive op, then the kernel bench at 4B/30B shapes) ----
echo "## gpu_check: gated delta product"
if $dry_run; then
    TRITON_INTERPRET=1 python scripts/check_gdp_triton.py --tiny --dtype float32 || status=1
    TRITON_INTERPRET=1 python scripts/bench.py gdp --tiny || status=1
else
    python scripts/check_gdp_triton.py --dtype bfloat16 || status=1
    # the fp32 tests hold the kernels to fp32 tolerances: fp32 dots in IEEE fp32, not TF32
    TRITON_F32_DEFAULT=ieee python -m pytest -q -p no:cacheprovider tests/test_gdp_triton.py tests/test_gdp_op.py \
        || status=1
    python scripts/bench.py gdp --repeats 10 || status=1
fi

# ---- section: scale (training with compile, memory vs scripts/plan_memory.py per AC mode, float8) ----
echo "## gpu_check: scale"
python scripts/gpu_check_memory.py "$@" || status=1

# ---- section: decoding (the compiled decode step as CUDA graphs, against eager and transformers' generate) ----
# Tokens/s at batch 1, 8 and 64 and k = 1 and the model's K, time to first token, each graph's first call
# apart, greedy outputs compared (a fresh debug model: near-tied logits may flip a token between fused and
# unfused kernels; the count says how many rows agree); then k = 1 against the non-recurrent model.
echo "## gpu_check: decoding"
if $dry_run; then
    python scripts/bench.py decode --flavor debug --max-loops 2 --batches 1 2 --seq-len 8 --new-tokens 4 --repeats 1 \
        || status=1
else
    python scripts/bench.py decode --flavor debug --max-loops 4 --batches 1 8 64 --seq-len 64 --new-tokens 128 \
        --repeats 5 || status=1
    python scripts/bench.py decode --flavor gpt_0p5b --max-loops 4 --batches 1 8 64 --seq-len 128 --new-tokens 128 \
        --repeats 3 || status=1
fi

# ---- section: the depth study (pointer chasing: 6 variants x 3 seeds at once on the one GPU; not yet timed on one) ----
echo "## gpu_check: depth study"
if $dry_run; then
    python scripts/study.py --suite depth --seeds 0 --variants baseline_matched elr --steps 4 --val-steps 1 \
        --extrapolation-examples 64 --runs outputs/gpu_check/depth/runs --out outputs/gpu_check/depth || status=1
else
    python scripts/study.py --suite depth --seeds 0 1 2 --jobs 18 --runs outputs/gpu_check/depth/runs \
        --variants baseline_matched untied_k4 elr elr_paper elr_fixed4 elr_k4_heavy \
        --out outputs/gpu_check/depth || status=1
    cat outputs/gpu_check/depth/results.md
fi

exit $status
