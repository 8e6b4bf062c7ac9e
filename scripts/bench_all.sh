#!/usr/bin/env bash
# Run every benchmark of docs/benchmarks.md, one after the other, and make the plots.
#
#   scripts/bench_all.sh [--quick] [--genai-venv PATH] [--out DIR] [--baseline PATH]
#
# --quick: a smoke run of every script (short prompts, 2 repetitions, 8 new tokens), a few
# minutes. Without it: the full run (5 repetitions, prompts up to 4000 tokens, 32 new tokens).
# fp32 (base) everywhere; INT4 for table 1 and the weights table, which keeps the full run
# under 20 minutes on 2 cores.
# --baseline PATH: another checkout of the repository for table 6's single-request part
# (skipped without it).
# Tables land in DIR (default bench-out/) as .md and .json, plots in docs/benchmarks/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/bench-out"
GENAI_VENV="$ROOT/.venv-genai"
QUICK=()
BASELINE=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=(--quick); shift ;;
        --genai-venv) GENAI_VENV="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --baseline) BASELINE=(--baseline "$2"); shift 2 ;;
        *) echo "unknown option $1 (expected --quick, --genai-venv PATH, --out DIR," \
                "--baseline PATH)" >&2; exit 2 ;;
    esac
done

cd "$ROOT"
step() {
    local began=$SECONDS
    echo "== $*" >&2
    "$@"
    echo "== $(( SECONDS - began )) s: $*" >&2
}

for variant in base int4; do
    step "$PY" scripts/bench_vs_genai.py "${QUICK[@]}" --out "$OUT" --genai-venv "$GENAI_VENV" \
        --variant "$variant"
done
step "$PY" scripts/bench_chunking.py "${QUICK[@]}" --out "$OUT"
step "$PY" scripts/bench_overhead.py "${QUICK[@]}" --out "$OUT"
step "$PY" scripts/bench_padding.py "${QUICK[@]}" --out "$OUT"
for variant in base int4; do
    step "$PY" scripts/bench_weights.py "${QUICK[@]}" --out "$OUT" --variant "$variant"
done
# Table 6: the batch engine (3 rounds: each round serves 16 prompts three times and admits a
# 4000-token prompt twice), then its memory, single-request and prefill-batching parts.
step "$PY" scripts/bench_engine.py "${QUICK[@]}" --out "$OUT" --genai-venv "$GENAI_VENV" \
    --repetitions 3 "${BASELINE[@]}"
# Table 5: the tiny decoder at W=64 already runs in seconds, so --quick changes nothing here.
began=$SECONDS
step "$PY" scripts/cache_thrash.py | tee "$OUT/cache_thrash.md"
echo "cache_thrash.py wall time: $(( SECONDS - began )) s" >> "$OUT/cache_thrash.md"
step "$PY" scripts/bench_plots.py --out "$OUT"
echo "total: $SECONDS s" >&2
