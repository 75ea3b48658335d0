#!/usr/bin/env bash
# GPU benchmark: sampler tokens/s and train-step MFU of a random 0.5B-shaped model
# (preset qwen2.5-0.5b) in bfloat16, against this GPU's measured bf16 matmul rate.
# Appends the results, dated, to experiments/BENCHMARKS.md.
#
#   experiments/gpu_bench.sh                 # from the repository root, on an NVIDIA machine
#   CUDA=cuda13 experiments/gpu_bench.sh     # jax[cuda13] instead of jax[cuda12]
#   VENV=/tmp/gpu-venv ROWS=16 T=1024 experiments/gpu_bench.sh
#
# It makes its own venv (so the CPU venv is untouched), installs the project with
# jax[$CUDA], checks that JAX sees a GPU (and stops if not), runs
# `python -m erpo_jax.tools.bench --gpu`, and appends the table to BENCHMARKS.md.
set -euo pipefail

cd "$(dirname "$0")/.."
CUDA=${CUDA:-cuda12}
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
PRESET=${PRESET:-qwen2.5-0.5b}
ROWS=${ROWS:-16}
T=${T:-1024}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=${OUT:-experiments/gpu_bench.json}
LOG=${LOG:-experiments/gpu_bench.log}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e . "jax[$CUDA]"

"$VENV/bin/python" - <<'PY'
import sys
import jax
gpus = [d for d in jax.devices() if d.platform == "gpu"]
if not gpus:
    sys.exit(f"gpu_bench.sh: JAX sees no GPU (devices: {jax.devices()}); check the driver "
             "and the CUDA extra (CUDA=cuda12 or cuda13).")
print("JAX", jax.__version__, "on", gpus[0].device_kind, f"x{len(gpus)}")
PY

# One device: the numbers are per chip.
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$VENV/bin/python" -m erpo_jax.tools.bench --gpu \
    --gpu-preset "$PRESET" --gpu-rows "$ROWS" --gpu-T "$T" --gpu-new-tokens "$NEW_TOKENS" \
    --out "$OUT" 2>&1 | tee "$LOG"

"$VENV/bin/python" - "$OUT" "$LOG" "$PRESET" "$ROWS" "$T" "$NEW_TOKENS" <<'PY'
import json
import sys
from pathlib import Path

out, log, preset, rows, T, new = sys.argv[1:]
r = json.loads(Path(out).read_text())
m, p = r["mfu"], r["matmul_peak"]
lines = [
    "",
    f"## GPU run, {r['date']} ({r['device_kind']}, JAX {r['jax']})",
    "",
    f"Command: `experiments/gpu_bench.sh` (PRESET={preset} ROWS={rows} T={T} "
    f"NEW_TOKENS={new}); raw results in `{out}`.",
    "",
    f"- bf16 matmul peak ({p['n']}^2, chain of 4): {p['flops_per_s'] / 1e12:.1f} TFLOP/s",
    f"- train step ({m['preset']}, {m['params_m']:.0f}M params, {m['dtype']}, {m['rows']} x "
    f"{m['T']} tokens): {m['wall_s']['update'] * 1e3:.1f} ms, "
    f"{m['model_flops_per_s'] / 1e12:.1f} TFLOP/s, **MFU {100 * m['mfu']:.1f}%** "
    f"({m['formula']})",
    "",
    "| batch | decode tokens/s (KV cache) | no-cache baseline | x no-cache |",
    "|---:|---:|---:|---:|",
]
for x in r["sampler"]["rows"]:
    lines.append(f"| {x['batch']} | {x['jax_kv_cache']:,.0f} | {x['jax_no_cache']:,.0f} | "
                 f"{x['speedup_vs_no_cache']:.1f} |")
s = r["sampler"]["settings"]
lines += ["", f"Sampler: greedy, prompt {s['prompt_len']}, {s['new_tokens']} new tokens, "
          f"prefill included, {s['dtype']}.", ""]
with open("experiments/BENCHMARKS.md", "a") as f:
    f.write("\n".join(lines))
print("appended to experiments/BENCHMARKS.md")
PY
