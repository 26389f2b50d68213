#!/usr/bin/env bash
# Builds the project with sanitizers (CUDA off) and runs the suites under them
# (docs/architecture.md#sanitizers).
#
#   tests/sanitize/run.sh asan [ctest args]   AddressSanitizer + UndefinedBehaviorSanitizer:
#                                             the unit, integration and fuzz-replay suites
#   tests/sanitize/run.sh tsan [ctest args]   ThreadSanitizer: the transport, EP layer,
#                                             rebalance, agent, report-sender, RPC, TLS and elastic suites
#
# Build folder: ${MOE_BUILD_DIR:-build}-asan or -tsan. Every finding fails its test:
# UBSan does not recover, ASan and TSan exit non-zero. Suppressions for third-party code
# are in tests/sanitize/*.supp, each with its reason. The deploy checks (scripts around the
# binaries) and the GPU cases do not run here.
set -euo pipefail
source "$(dirname "$0")/../../deploy/local/common.sh"

kind=${1:-}
shift || true
case "$kind" in
  asan) sanitize=address,undefined ;;
  tsan) sanitize=thread ;;
  *) echo "usage: $0 asan|tsan [ctest args]" >&2; exit 2 ;;
esac
supp="$MOE_ROOT/tests/sanitize"
build="${MOE_BUILD_DIR}-$kind"

moe_install_deps
log "configuring $kind build in $build"
# -O1 -g1: quick to build, fast enough to run, line numbers in reports; NDEBUG as the
# Release build and the distribution's libraries have it. No Python package: a
# sanitized module cannot load into the distribution's interpreter.
cmake -S "$MOE_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DMOE_SANITIZE="$sanitize" -DMOE_WITH_CUDA=OFF -DMOE_PYTHON=OFF >/dev/null
# The build runs the test binaries too (GoogleTest's discovery): the options apply
# from here on. Children (moed, moe-agent, moectl, test workers) inherit them.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=23:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
# UCX's memory-event hooks (ucm) intercept mmap/madvise and crash under TSan at
# thread exit; the project does not need them (it registers no memory with UCX).
export UCX_MEM_EVENTS=no

log "building ($kind) with $MOE_JOBS jobs"
ninja -C "$build" -j "$MOE_JOBS"

log "running tests ($kind)"
if [ "$kind" = asan ]; then
  ctest --test-dir "$build" --output-on-failure -j "$MOE_JOBS" -LE 'deploy|thrash' -E 'Cuda|Nccl|Gpu' "$@"
else
  ctest --test-dir "$build" --output-on-failure -j "$MOE_JOBS" \
    -R 'Communicator|Transport|Bootstrap|LocalHub|Ep[A-Z]|EpLayer|Rebalance|rebalance|Agent|Scheduler|ReportSender|LiveLoad|Rpc|Tls|UcxJobKey|OnTheWire|Elastic|WorldChange|Overlap|ChunkRule|Wire|Serve' \
    "$@"
fi
