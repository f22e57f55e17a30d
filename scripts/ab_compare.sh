#!/usr/bin/env bash
# One command, run in several trees on the GPU machine, one after the other,
# each with its own CuPy kernel cache: BASE (a git revision, extracted with
# `git archive` into a temporary folder) and the working tree (or NEW, a
# second revision); output in $OUT/ab_base.txt and $OUT/ab_new.txt.  For an
# experiment kept on a branch: measure it against main in one device call.
#
#   BASE=main NEW=occupancy-3blocks bash scripts/ab_compare.sh \
#       python3 benchmarks/group_norm.py --cases 1x512x512x128 --dtypes float16 --json -
#
# TREES="main 7902a37 0822f16" (instead of BASE/NEW): every tree in turn, a
# stack of commits measured step by step; output in $OUT/ab_<i>_<tree>.txt.
# benchmarks/ab_table.py puts the depthwise benchmark's outputs side by side.
#
# A revision may also name a folder holding a tree: the GPU machine's copy
# of .git can be stale, so extract there-bound trees here
# (`mkdir _ab_new && git archive REV | tar -x -C _ab_new`: an untracked
# folder travels with the working tree) and pass NEW=_ab_new; delete it after.
# The command runs from each tree's root with PYTHONPATH=<tree>:<tree>/benchmarks.
# AB_CACHE_DIR: one CuPy kernel cache for every tree (its key is the kernel's
# source and options, so kernels a commit did not touch compile once) instead
# of a fresh cache per tree, whose point is to time cold compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: BASE=<rev> [NEW=<rev>] $0 COMMAND...  or  TREES='<rev> <rev> ...' $0 COMMAND..." >&2; exit 2; }
OUT=${OUT:-/tmp/dwgn_out}; mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tree_of() {  # tree_of REV|"" NAME -> a folder holding that tree ("" = the working tree)
  if [ -z "$1" ]; then echo "$PWD"; return; fi
  if [ -d "$1" ]; then (cd "$1" && pwd); return; fi
  mkdir -p "$work/$2" && git archive "$1" | tar -x -C "$work/$2" && echo "$work/$2"
}
if [ -n "${TREES:-}" ]; then
  revs=($TREES)
  names=()
  for i in "${!revs[@]}"; do names+=("${i}_$(printf %s "$(basename "${revs[$i]}")" | tr -c 'A-Za-z0-9_.-' '_')"); done
else
  : "${BASE:?set BASE to a git revision (or TREES to several)}"
  revs=("$BASE" "${NEW:-}")
  names=(base new)
fi
status=0
for i in "${!revs[@]}"; do
  rev=${revs[$i]} name=${names[$i]}
  tree=$(tree_of "$rev" "$name") || { echo "cannot extract $rev" >&2; exit 2; }
  echo "== $name: ${rev:-working tree}" | tee "$OUT/ab_$name.txt"
  (cd "$tree" && PYTHONPATH="$tree:$tree/benchmarks" CUPY_CACHE_DIR="${AB_CACHE_DIR:-$work/cache_$name}" "$@") 2>&1 \
    | tee -a "$OUT/ab_$name.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
