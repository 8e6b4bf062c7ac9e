#!/usr/bin/env bash
# The first run on a GPU, one command, at most 9.5 minutes by its own timeouts: every step in
# its own process under its own timeout, and always one table at the end, a failed or
# timed-out step being a row with its reason. The steps (docs/cuda.md, "The first GPU run"):
#   environment      ONNX Runtime build, driver, which libcudart the process maps
#   version surface  the API the CUDA path uses, in the staged wheel
#   device identity  the owned KV bound as past and present: two decode runs write the row at
#                    seqlens_k in place; logits equal those with ONNX Runtime's buffers
#   native chunks    padded = unpadded on the device (recorded per build when it holds)
#   concurrency      one thread opening/closing sequences for every-row logits while another
#                    captures each tier and replays: fallbacks, CUDA errors, logits
#   cuda_probe.py    scripts/cuda_probe.py --preset tiny
#   gpu_check.sh     scripts/gpu_check.sh --preset tiny
#
#   scripts/gpu_first_run.sh [--dry-run [--simulate capture-failure]] [--python PYTHON]
#                            [--device-id N] [--only STEP]
#
# --only STEP runs that one step (a name above), to rerun a failed one on the lent machine.
# On the lent machine onnxruntime-gpu comes from scripts/stage_ort_gpu.py ($ORT_SITE_DIR,
# default /tmp/ort-site), else from the interpreter. --dry-run runs every step on CPU (the CPU
# device dressed as CUDA) and prints every row; --simulate capture-failure makes its first
# capture fail, as the concurrency rows must then show. Logs go under $OUT when set.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
SIMULATE=""
DEVICE_ID=0
ONLY=""
PYTHON="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --simulate) SIMULATE="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    --device-id) DEVICE_ID="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    *) echo "error: unknown argument $1 (expected --dry-run, --simulate capture-failure," \
            "--python PYTHON, --device-id N, --only STEP)" >&2
       exit 2 ;;
  esac
  shift
done
if [ -n "$SIMULATE" ] && { [ "$DRY_RUN" = 0 ] || [ "$SIMULATE" != capture-failure ]; }; then
  echo "error: --simulate capture-failure goes with --dry-run only" >&2
  exit 2
fi
LOGS="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-first-run.XXXXXX")}"
mkdir -p "$LOGS"
ROWS="$LOGS/rows.txt"
: >"$ROWS"

STEP_ARGS=(--device-id "$DEVICE_ID")
TOOL_ARGS=(--preset tiny)
if [ "$DRY_RUN" = 1 ]; then
  STEP_ARGS+=(--dry-run)
  TOOL_ARGS+=(--dry-run)
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  SITE="${ORT_SITE_DIR:-/tmp/ort-site}"
  if [ -d "$SITE/onnxruntime" ]; then
    # onnxruntime.preload_dlls() looks for the nvidia-* wheels' libraries beside onnxruntime.
    if [ ! -e "$SITE/nvidia" ]; then
      NVIDIA="$("$PYTHON" -c 'import pathlib, site
print(next((str(p / "nvidia") for p in map(pathlib.Path, site.getsitepackages())
            if (p / "nvidia").is_dir()), ""))' 2>/dev/null)"
      if [ -n "$NVIDIA" ]; then ln -s "$NVIDIA" "$SITE/nvidia"; fi
    fi
    export PYTHONPATH="$SITE:$ROOT"
  else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONUNBUFFERED=1

# name | timeout (s) | command. The timeouts add up to 570 s, 584 s with the 2 s each may take
# to be killed (tests/cuda/test_gpu_first_run_dry_run.py holds them under 10 minutes).
STEPS=(
  "environment|30|$PYTHON scripts/gpu_first_run.py environment"
  "version surface|20|$PYTHON scripts/gpu_first_run.py surface"
  "device identity|60|$PYTHON scripts/gpu_first_run.py identity"
  "native chunks|60|$PYTHON scripts/gpu_first_run.py native"
  "concurrency|90|$PYTHON scripts/gpu_first_run.py concurrency"
  "cuda_probe.py|150|$PYTHON scripts/cuda_probe.py"
  "gpu_check.sh|160|bash scripts/gpu_check.sh --python $PYTHON"
)

if [ -n "$ONLY" ]; then
  names=()
  for entry in "${STEPS[@]}"; do names+=("${entry%%|*}"); done
  kept=()
  for entry in "${STEPS[@]}"; do
    if [ "${entry%%|*}" = "$ONLY" ]; then kept+=("$entry"); fi
  done
  if [ "${#kept[@]}" = 0 ]; then
    printf -v known '%s, ' "${names[@]}"
    echo "error: --only $ONLY is no step (the steps: ${known%, })" >&2
    exit 2
  fi
  STEPS=("${kept[@]}")
fi

row() {  # name, verdict, detail
  printf 'row: %s | %s | %s\n' "$1" "$2" "$3" >>"$ROWS"
}

for entry in "${STEPS[@]}"; do
  IFS='|' read -r name limit command <<<"$entry"
  log="$LOGS/$(echo "$name" | tr ' .' '__').log"
  extra=("${STEP_ARGS[@]}")
  case "$name" in
    cuda_probe.py) extra=("${TOOL_ARGS[@]}") ;;
    gpu_check.sh) extra=("${TOOL_ARGS[@]}") ;;
    concurrency) if [ -n "$SIMULATE" ]; then extra+=(--simulate "$SIMULATE"); fi ;;
  esac
  started=$SECONDS
  # shellcheck disable=SC2086
  OUT="$LOGS/${name// /_}.out" timeout --kill-after=2 "$limit" $command "${extra[@]}" \
    >"$log" 2>&1
  status=$?
  took=$((SECONDS - started))
  found=0
  if [ "$name" = "gpu_check.sh" ]; then
    # Its own table: every line after the header "check  result  detail".
    while IFS= read -r line; do
      check="$(echo "${line:0:30}" | sed 's/ *$//')"
      rest="${line:32}"
      verdict="${rest%% *}"
      row "gpu_check: $check" "$verdict" "$(echo "${rest#"$verdict"}" | sed 's/^ *//')"
      found=1
    done < <(sed -n '/^check  *result  *detail/,$p' "$log" | tail -n +2 \
             | grep -E '^.{32}(ok|FAIL|info)( |$)')
  else
    while IFS= read -r line; do
      echo "$line" >>"$ROWS"
      found=1
    done < <(grep '^row: ' "$log")
  fi
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    row "$name" FAIL "timed out after ${limit} s; last line: $(grep -v '^row: ' "$log" | tail -n 1 | cut -c1-160)"
  elif [ "$found" = 0 ]; then
    row "$name" FAIL "status $status after ${took} s and no row; last line: $(tail -n 1 "$log" | cut -c1-160)"
  fi
done

echo "logs: $LOGS"
printf '\n%-36s  %-6s  %s\n' "check" "result" "detail"
failed=0
while IFS= read -r line; do
  body="${line#row: }"
  name="${body%% | *}"
  rest="${body#* | }"
  verdict="${rest%% | *}"
  detail="${rest#* | }"
  printf '%-36s  %-6s  %s\n' "$name" "$verdict" "$detail"
  if [ "$verdict" = FAIL ]; then failed=1; fi
done <"$ROWS"
exit "$failed"
