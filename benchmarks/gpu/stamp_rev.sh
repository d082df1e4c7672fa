#!/usr/bin/env bash
# Write the checkout's commit (and "+dirty" when tracked files differ from it) to .lily-rev
# (git-ignored), for benchmarks/gpu/suite.sh on a GPU machine without the git history:
#   bash benchmarks/gpu/stamp_rev.sh   # then carry ".lily-rev" with the device call
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$(git rev-parse HEAD)
[ -n "$(git status --porcelain --untracked-files=no)" ] && rev="$rev+dirty"
echo "$rev" > .lily-rev
echo "$rev"
