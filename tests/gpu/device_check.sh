#!/usr/bin/env bash
# The device check (docs/device-check.md): on a machine with a GPU, CUDA, CMake and ninja (no
# Debian dependencies, no network), builds the kernels-only tree, runs every CUDA
# check and the GPU benchmarks, and the eager PyTorch layer on the same GPU when
# PyTorch is there. Writes into OUTDIR:
#   build.log, checks.log (one line per check, then "N passed, N failed"),
#   gpu_bench.jsonl (moe-gpu-check --bench), torch_layer.json, summary.txt.
# Budget: 4 minutes in all, build included; each step has its own timeout.
#
#   tests/gpu/device_check.sh OUTDIR
set -uo pipefail

out=${1:?usage: tests/gpu/device_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${MOE_DEVICE_BUILD:-$root/build-device}
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
say() { echo "[$((SECONDS - start)) s] $*" | tee -a "$out/summary.txt"; }

: >"$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
say "device: $(tail -n +2 "$out/nvidia-smi.csv" 2>/dev/null | head -1)"

if ! timeout 150 bash -c "cmake -S '$root' -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_KERNELS_ONLY=ON \
      && ninja -C '$build' -j$(nproc) moe-gpu-check" >"$out/build.log" 2>&1; then
  say "build FAILED (build.log):"
  tail -30 "$out/build.log" | tee -a "$out/summary.txt"
  exit 1
fi
say "built"

check=$build/tests/gpu/moe-gpu-check
timeout 60 "$check" >"$out/checks.log" 2>&1
checks_rc=$?
grep -E '^FAIL|passed, ' "$out/checks.log" | tee -a "$out/summary.txt"
[ "$checks_rc" -le 1 ] || tail -5 "$out/checks.log" | tee -a "$out/summary.txt"
say "checks exit $checks_rc"

timeout 90 "$check" --no-checks --bench --out "$out" >"$out/bench.log" 2>&1
bench_rc=$?
[ "$bench_rc" -eq 0 ] || tail -5 "$out/bench.log" | tee -a "$out/summary.txt"
say "benchmarks exit $bench_rc (gpu_bench.jsonl)"
[ -f "$out/gpu_bench.jsonl" ] && tee -a "$out/summary.txt" <"$out/gpu_bench.jsonl"

if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  timeout 60 python3 "$root/daemon/bench/torch_layer.py" --device cuda --dtype bf16 --tokens 16384 --hidden 4096 \
    --ffn 1536 --experts 64 --top-k 8 --iters 10 --warmup 3 >"$out/torch_layer.json" 2>"$out/torch_layer.log"
  say "torch layer exit $?"
  tee -a "$out/summary.txt" <"$out/torch_layer.json"
  python3 - "$out" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
out = sys.argv[1]
torch = json.load(open(f"{out}/torch_layer.json"))
for line in open(f"{out}/gpu_bench.jsonl"):
    r = json.loads(line)
    if r.get("bench") == "gpu_layer":
        peer = torch[f"{r['mode']}_tokens_per_second"]
        print(f"layer {r['mode']}: {r['tokens_per_second']:.0f} tok/s, eager PyTorch {peer:.0f} tok/s, "
              f"ratio {r['tokens_per_second'] / peer:.2f}")
EOF
else
  say "no PyTorch with CUDA here: the eager PyTorch peer did not run"
fi
say "done"
exit "$checks_rc"
