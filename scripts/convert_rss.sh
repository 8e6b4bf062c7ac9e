#!/usr/bin/env bash
# Peak resident memory of `onnx-chunk convert` on a decoder with about 2 GB of external data.
#
# Builds the bench preset scaled up (about 1.9 GB of fp32 weights) into a temporary folder,
# converts it under `/usr/bin/time -v`, prints the weight size and the peak RSS, and removes
# everything it wrote. Usage: scripts/convert_rss.sh  (ONNX_CHUNK overrides the command).
set -euo pipefail

onnx_chunk="${ONNX_CHUNK:-onnx-chunk}"
work="$(mktemp -d "${TMPDIR:-/tmp}/convert_rss.XXXXXX")"
trap 'rm -rf "$work"' EXIT

"$onnx_chunk" build-model bench -o "$work/in" \
    --hidden 2048 --heads 16 --kv-heads 4 --intermediate 5632 >/dev/null
weights=$(du -cb "$work"/in/*.data | tail -n 1 | cut -f 1)

/usr/bin/time -v -o "$work/time.txt" "$onnx_chunk" convert "$work/in/model.onnx" \
    -o "$work/out" >/dev/null
peak_kb=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$work/time.txt")
elapsed=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$work/time.txt")

printf 'external data: %d MB\n' $((weights / 1000000))
printf 'convert peak RSS: %d MB (wall %s)\n' $((peak_kb / 1024)) "$elapsed"
