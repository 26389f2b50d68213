# shellcheck shell=bash
# Sourced by the deploy tests (tests/deploy/*_test.sh). ctest sets MOE_DEPLOY_CACHE (a folder in
# the build tree for npm packages and locks) and MOE_BUILD_DIR.
# Exit status 77 means "skipped" (ctest SKIP_RETURN_CODE): only for a package that cannot be
# installed here, always with the reason. Under CI=true (CI runs as root, with the packages the
# scripts install) a missing prerequisite is a failure: a skip there would hide one.

MOE_SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MOE_BUILD_DIR=${MOE_BUILD_DIR:-$MOE_SRC/build}
MOE_DEPLOY_CACHE=${MOE_DEPLOY_CACHE:-$MOE_BUILD_DIR/deploy-cache}
mkdir -p "$MOE_DEPLOY_CACHE"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
skip() {
  if [ "${CI:-}" = true ]; then
    printf 'FAIL (CI=true, where every prerequisite must be present): %s\n' "$*" >&2
    exit 1
  fi
  printf 'SKIP: %s\n' "$*" >&2
  exit 77
}

# need_packages PKG...: installs the Debian packages that are missing (apt-get; root or sudo),
# or skips the test naming them. One installer at a time across parallel tests.
need_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null || ! sudo -n true 2>/dev/null; then
      skip "cannot install ${missing[*]}: not root and no sudo"
    fi
    sudo=(sudo -n)
  fi
  log "installing ${missing[*]}"
  if ! (
    flock 9
    "${sudo[@]}" apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
        -o DPkg::Lock::Timeout=300 "${missing[@]}" >"$MOE_DEPLOY_CACHE/apt.log" 2>&1
  ) 9>"$MOE_DEPLOY_CACHE/apt.lock"; then
    tail -n 5 "$MOE_DEPLOY_CACHE/apt.log" >&2
    skip "cannot install ${missing[*]} with apt-get (see $MOE_DEPLOY_CACHE/apt.log)"
  fi
}

# need_node_modules: the npm packages of tests/deploy/node (package-lock.json) in
# $MOE_DEPLOY_CACHE/node/node_modules, installed with `npm ci` when the lock file changed.
# Sets NODE_DIR.
need_node_modules() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    need_packages nodejs npm
  fi
  NODE_DIR=$MOE_DEPLOY_CACHE/node
  mkdir -p "$NODE_DIR"
  (
    flock 9
    if ! cmp -s "$MOE_SRC/tests/deploy/node/package-lock.json" "$NODE_DIR/installed-lock.json"; then
      cp "$MOE_SRC/tests/deploy/node/package.json" "$MOE_SRC/tests/deploy/node/package-lock.json" "$NODE_DIR/"
      log "npm ci in $NODE_DIR"
      if ! (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error >npm.log 2>&1); then
        tail -n 5 "$NODE_DIR/npm.log" >&2
        exit 77
      fi
      cp "$NODE_DIR/package-lock.json" "$NODE_DIR/installed-lock.json"
    fi
  ) 9>"$MOE_DEPLOY_CACHE/npm.lock" || {
    [ $? -eq 77 ] && skip "cannot install the npm packages of tests/deploy/node (npm ci failed; see $NODE_DIR/npm.log)"
    fail "npm ci"
  }
}

# A fresh temporary folder, removed at exit (the caller's EXIT trap must call cleanup_tmp).
make_tmp() {
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/moe-deploy.XXXXXX")
}
cleanup_tmp() {
  [ -n "${TMP:-}" ] && rm -rf "$TMP"
}

# Flags the deployment files pass that the C++ side has announced but the binaries do
# not accept yet, as BINARY:--flag. The tests that run or check command lines leave them out and
# say so (a NOTE line); once a binary's --help lists one, those tests fail until it is taken off
# this list, so the exception cannot outlive its reason.
MOE_PENDING_FLAGS=()

# pending_flags NAME PATH: prints the pending flags of binary NAME that PATH --help lacks, one a
# line (with a NOTE on stderr); fails the test if --help lists one of them.
pending_flags() {
  local name=$1 path=$2 entry flag help
  help=$("$path" --help 2>&1 || true)
  for entry in "${MOE_PENDING_FLAGS[@]}"; do
    [ "${entry%%:*}" = "$name" ] || continue
    flag=${entry#*:}
    if grep -qE -- "(^|[[:space:],])$flag([[:space:]=]|$)" <<<"$help"; then
      fail "$name now accepts $flag: take it off MOE_PENDING_FLAGS in tests/deploy/lib.sh"
    fi
    log "NOTE: $name does not accept $flag yet (MOE_PENDING_FLAGS in tests/deploy/lib.sh): left out here"
    echo "$flag"
  done
}
