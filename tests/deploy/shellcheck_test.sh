#!/usr/bin/env bash
# Runs shellcheck on every shell script in the repository: the files git tracks (or would track) that
# end in .sh, .bash or .sbatch or start with a sh/bash shebang. Sourced files are followed from
# each script's own folder (-x -P SCRIPTDIR). Every finding fails, whoever owns the script.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
command -v shellcheck >/dev/null || need_packages shellcheck
cd "$MOE_SRC"
scripts=()
while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue
  case $f in
    *.sh | *.bash | *.sbatch) scripts+=("$f") ;;
    *) head -n 1 "$f" 2>/dev/null | grep -qE '^#!.*([/ ](ba|da|k)?sh)([[:space:]]|$)' && scripts+=("$f") ;;
  esac
done < <(git ls-files -z --cached --others --exclude-standard 2>/dev/null ||
  find . -path ./build -prune -o -path ./.git -prune -o -type f -print0)
[ ${#scripts[@]} -gt 0 ] || fail "found no shell scripts"
log "shellcheck $(shellcheck --version | sed -n 's/^version: //p') on ${#scripts[@]} scripts: ${scripts[*]}"
shellcheck -x -P SCRIPTDIR "${scripts[@]}"
echo "ok: ${#scripts[@]} scripts clean"
