#!/usr/bin/env bash
# Coverage-guided fuzzing campaigns (docs/architecture.md#fuzzing): builds the fuzz targets
# as libFuzzer binaries with clang (ASan + UBSan, CUDA off) in ${MOE_BUILD_DIR}-fuzz, runs
# each for SECONDS (default 600) starting from its kept corpus, merges what found new
# coverage into tests/fuzz/corpus/<target>/ (replayed by ctest), and prints per target the
# executions, the coverage and any crash (a crash-* file and the command to reproduce it).
#   tests/fuzz/campaign.sh [SECONDS] [TARGET...]
#     targets: frame safetensors checkpoint_index placement_file checkpoint_manifest metrics_request
set -euo pipefail
source "$(dirname "$0")/../../deploy/local/common.sh"
seconds=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame safetensors checkpoint_index placement_file checkpoint_manifest metrics_request)
build="${MOE_BUILD_DIR}-fuzz"

moe_install_deps
moe_apt_install clang-14 libclang-rt-14-dev
log "configuring the fuzz build in $build"
CC=clang-14 CXX=clang++-14 cmake -S "$MOE_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DMOE_FUZZ=ON -DMOE_WITH_CUDA=OFF \
  `# Boost 1.74 enables co_await on clang only with libc++; libstdc++ has <coroutine> too.` \
  -DCMAKE_CXX_FLAGS="-DBOOST_ASIO_HAS_CO_AWAIT=1 -DBOOST_ASIO_HAS_STD_COROUTINE=1" \
  `# which libraries are instrumented: tests/fuzz/CMakeLists.txt` >/dev/null
ninja -C "$build" -j "$MOE_JOBS" "${targets[@]/%/_libfuzzer}"

export ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
status=0
for t in "${targets[@]}"; do
  kept="$MOE_ROOT/tests/fuzz/corpus/$t" work="$build/campaign/$t"
  mkdir -p "$kept" "$work/new" "$work/crashes"
  log "$t: ${seconds} s"
  set +e
  "$build/tests/fuzz/${t}_libfuzzer" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix="$work/crashes/" "$work/new" "$kept" >"$work/log" 2>&1
  rc=$?
  set -e
  # Keep only inputs that add coverage to what the corpus had.
  "$build/tests/fuzz/${t}_libfuzzer" -merge=1 "$kept" "$work/new" >"$work/merge.log" 2>&1 || true
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$work/log" | awk '{print $2}')
  cov=$(grep -o 'cov: [0-9]*' "$work/log" | tail -1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$work/log" | tail -1 | awk '{print $2}')
  crashes=$(find "$work/crashes" -type f | wc -l)
  printf '%s: %s executions in %s s, coverage %s edges (%s features), corpus %s inputs, %s crash(es)%s\n' \
    "$t" "${execs:-?}" "$seconds" "${cov:-?}" "${ft:-?}" "$(find "$kept" -type f | wc -l)" "$crashes" \
    "$([ "$crashes" -gt 0 ] && echo ": $(find "$work/crashes" -type f | head -1) (reproduce: $build/tests/fuzz/${t}_libfuzzer FILE)")"
  [ $rc -eq 0 ] && [ "$crashes" -eq 0 ] || status=1
done
exit $status
