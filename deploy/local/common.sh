# shellcheck shell=bash
# Shared by demo.sh and test.sh: install what is missing, configure, build.
# Sourced, not run. Honours MOE_BUILD_DIR (default: build/ in the checkout) and
# MOE_JOBS (default: the core count, at most 2 on the 2-core machines we target).

MOE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MOE_BUILD_DIR=${MOE_BUILD_DIR:-$MOE_ROOT/build}
MOE_JOBS=${MOE_JOBS:-$(nproc)}

# Debian 12 packages the build and the tests need.
MOE_PACKAGES=(
  cmake ninja-build g++ pkg-config
  libopenblas-dev libdnnl-dev
  libucx-dev ucx-utils
  libboost-dev libboost-system-dev libssl-dev
  libprotobuf-dev protobuf-compiler
  libcli11-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev
  iproute2 procps python3
  pybind11-dev python3-dev python3-numpy python3-torch
)
# What the deploy tests (tests/deploy, ctest label `deploy`) run: promtool, shellcheck,
# systemd-analyze, a one-machine Slurm with munge, and the dashboard lint's YAML reader. test.sh
# installs them where it can (a test whose package is missing installs it or skips); demo.sh does
# not: on a machine with systemd as init, prometheus, munge and slurm-wlm start their services
# when installed. node 20 and npm come with the base image; the tests fetch their npm packages.
MOE_TEST_PACKAGES=(
  prometheus shellcheck systemd slurm-wlm munge python3-yaml nftables
)

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Installs the packages of "$@" that are missing; fails if apt-get does.
moe_apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  log "installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

moe_install_deps() {
  moe_apt_install "${MOE_PACKAGES[@]}"
  if [ "$(basename "$0")" = test.sh ]; then
    moe_apt_install "${MOE_TEST_PACKAGES[@]}" ||
      log "could not install all of ${MOE_TEST_PACKAGES[*]}: the deploy tests that need them skip"
  fi
}

moe_build() {
  # nvcc lives outside PATH on a stock CUDA install; CMake enables CUDA when it finds it.
  if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  log "configuring in $MOE_BUILD_DIR"
  cmake -S "$MOE_ROOT" -B "$MOE_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  log "building with $MOE_JOBS jobs"
  ninja -C "$MOE_BUILD_DIR" -j "$MOE_JOBS"
}
