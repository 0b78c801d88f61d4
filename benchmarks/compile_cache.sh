#!/bin/bash
# The training bench's compile cache between lent-machine calls (benchmarks/device_call.sh, benchmarks/README.md).
#   bash benchmarks/compile_cache.sh pack DIR PREFIX      # DIR/compile as xz in parts PREFIX00, PREFIX01, ... of at
#                                                         # most PART_SIZE (15M: a file back from $OUT may hold 16 MiB)
#   bash benchmarks/compile_cache.sh unpack DIR PART...   # the parts, in order, back into DIR
# Python's lzma stands in where the machine has no xz.
set -o pipefail  # a failed tar fails the pack
xzc() { if command -v xz >/dev/null; then xz -T0 -6; else python3 -c 'import lzma, shutil, sys
out = lzma.open(sys.stdout.buffer, "wb", preset=3); shutil.copyfileobj(sys.stdin.buffer, out); out.close()'; fi; }
xzd() { if command -v xz >/dev/null; then xz -dc; else python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'; fi; }
case $1 in
  pack) [ -d "$2/compile" ] || { echo "compile_cache.sh: no compile cache in $2" >&2; exit 1; }
    tar cf - -C "$2" compile | xzc | split -b "${PART_SIZE:-15M}" -d - "$3" ;;
  unpack) dir=$2; shift 2; mkdir -p "$dir" && cat "$@" | xzd | tar xf - -C "$dir" ;;
  *) echo "usage: compile_cache.sh pack DIR PREFIX | unpack DIR PART..." >&2; exit 2 ;;
esac
