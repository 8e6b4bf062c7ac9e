#!/usr/bin/env bash
# The CUDA path on one GPU, in at most 8 minutes: scripts/gpu_check.py (environment, CPU
# float32 / CUDA float16 parity, graphs on and off, node placement, captures per pass from ORT's
# own log, device memory from cudaMemGetInfo per pass and after close, a second sequence, the
# graph plan's bound, the weights experiment), then the cache-thrash sequence on the GPU. Run
# scripts/cuda_probe.py first: it settles what the check assumes. The verdict table is printed
# last, whatever failed or timed out before it: an import that fails, a model that does not
# build, a step that raises are rows with their reason (gpu_check.py writes its rows as they
# come). Full logs go under $OUT when it is set (else a temporary folder, named at the end).
# GPU_CHECK_THRASH_PRESET names the cache-thrash model's preset (default tiny).
#
#   scripts/gpu_check.sh [--dry-run] [--preset NAME] [--python PYTHON]
#
# On the GPU machine onnxruntime-gpu comes from scripts/stage_ort_gpu.py (installed into
# $ORT_SITE_DIR, default /tmp/ort-site), which shadows the CPU onnxruntime through PYTHONPATH;
# the package runs from this checkout (PYTHONPATH), nothing is installed. --dry-run runs the
# same on CPU (the CPU device standing in for CUDA), with the tiny preset unless --preset says.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
PRESET=""
PYTHON="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --preset) PRESET="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    *) echo "error: unknown argument $1 (expected --dry-run, --preset NAME, --python PYTHON)" >&2
       exit 2 ;;
  esac
  shift
done
LOGS="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}"
mkdir -p "$LOGS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if [ "$DRY_RUN" = 1 ]; then
  PROVIDER=cpu
  PRESET="${PRESET:-tiny}"
  CHECK_ARGS=(--dry-run --chunk-size 32 --capacity 512 --new-tokens 6)
  THRASH_ARGS=(--chunk-size 32 --lengths 40,53,75,90,61 --new-tokens 3 --logits-rtol 1e-2)
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  PROVIDER=cuda
  PRESET="${PRESET:-bench}"
  CHECK_ARGS=()
  # float16 kernels tile differently per width: the modes agree within float16 noise.
  THRASH_ARGS=(--logits-rtol 1e-2)
  SITE="${ORT_SITE_DIR:-/tmp/ort-site}"
  if [ ! -d "$SITE/onnxruntime" ]; then
    echo "error: no onnxruntime-gpu in $SITE; stage it first (scripts/stage_ort_gpu.py)" >&2
    exit 2
  fi
  # onnxruntime.preload_dlls() looks for the nvidia-* wheels' libraries beside the onnxruntime
  # package; they are in the interpreter's own site-packages, so link them in.
  if [ ! -e "$SITE/nvidia" ]; then
    NVIDIA="$("$PYTHON" -c 'import pathlib, site
print(next((str(p / "nvidia") for p in map(pathlib.Path, site.getsitepackages())
            if (p / "nvidia").is_dir()), ""))')"
    if [ -n "$NVIDIA" ]; then ln -s "$NVIDIA" "$SITE/nvidia"; fi
  fi
  export PYTHONPATH="$SITE:$ROOT"
fi
export PYTHONUNBUFFERED=1

# The cache-thrash sequence runs a tiny float16 decoder: in float32 its attention would run on
# the CPU provider, not the GPU (CUDA's GroupQueryAttention is float16/bfloat16 only).
status=0
model_row=""
if "$PYTHON" -m onnx_chunk build-model "${GPU_CHECK_THRASH_PRESET:-tiny}" \
    -o "$WORK/thrash-model" --dtype float16 >"$LOGS/thrash_model.log" 2>&1; then
  THRASH_ARGS+=(--model "$WORK/thrash-model/model.onnx")
else
  echo "error: building the float16 thrash model failed; see $LOGS/thrash_model.log" >&2
  model_row="$(tail -n 1 "$LOGS/thrash_model.log" | cut -c1-200)"
fi
timeout 390 "$PYTHON" scripts/gpu_check.py --preset "$PRESET" --out "$WORK" \
  ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} >"$LOGS/gpu_check.log" 2>&1 || status=$?
cp "$WORK/results.json" "$LOGS/results.json" 2>/dev/null || true
cp -r "$WORK/ort-logs" "$LOGS/" 2>/dev/null || true
thrash=skipped
if [ -z "$model_row" ]; then
  timeout 90 "$PYTHON" scripts/cache_thrash.py --provider "$PROVIDER" \
    ${THRASH_ARGS[@]+"${THRASH_ARGS[@]}"} >"$LOGS/cache_thrash.log" 2>&1 && thrash=0 || thrash=$?
fi

echo "logs: $LOGS (gpu_check.log, ort-logs/, thrash_model.log, cache_thrash.log, results.json)"
if [ "$status" != 0 ] && [ "$status" != 1 ]; then
  echo "gpu_check.py ended with status $status (124: timed out); the end of its log:"
  tail -n 8 "$LOGS/gpu_check.log" | cut -c1-300
fi
if [ -f "$WORK/table.txt" ]; then
  cat "$WORK/table.txt"
else
  printf '%-30s  %-6s  %s\n' "check" "result" "detail"
fi
if [ "$status" != 0 ] && [ "$status" != 1 ]; then
  printf '%-30s  %-6s  %s\n' "gpu_check.py" "FAIL" "ended with status $status before its last row"
  status=1
fi
# Errors gpu_check.py printed (e.g. a graphs-on run that captured no CUDA graph), shown loudly.
grep '^error: ' "$LOGS/gpu_check.log" >&2 || true
if [ -n "$model_row" ]; then
  printf '%-30s  %-6s  %s\n' "thrash model build" "FAIL" "${model_row:-no output}"
  printf '%-30s  %-6s  %s\n' "cache thrash ($PROVIDER)" "FAIL" "not run: no thrash model"
  exit 1
fi
thrash_detail="$(grep -c '^ok  ' "$LOGS/cache_thrash.log" || true) checks ok, $(grep -c '^FAIL' "$LOGS/cache_thrash.log" || true) failed"
if [ "$thrash" = 0 ]; then verdict=ok; else verdict=FAIL; status=1; fi
printf '%-30s  %-6s  %s\n' "cache thrash ($PROVIDER)" "$verdict" "$thrash_detail (status $thrash)"
exit "$status"
