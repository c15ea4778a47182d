#!/usr/bin/env bash
# Start, or resume, recording SmolLM2-135M-Instruct's own conversations for its drafters, in the
# background (cascade record: see docs/real-model.md).
#
#   examples/models/smollm2/record.sh           # start, or resume after the last finished shard
#   examples/models/smollm2/record.sh status    # running or not; shards and tokens so far
#   examples/models/smollm2/record.sh stop      # stop it (the shard in progress is redone on resume)
#
# Everything goes to $SMOLLM2_WORK (default ~/.cache/cascade/work/smollm2, outside the git tree):
# record/ holds the shards and record.json, record.log the progress. Shards are a pure function
# of (seed, shard index, batch), so keep SEQUENCES' batch and seed unchanged across resumes;
# SEQUENCES may grow. It runs at low priority (nice 5) on THREADS threads (default 1), taking the
# CPU that nothing else wants (the rates seen so far: docs/results-log.md); THREADS=2 on an idle
# 2-core machine.
set -euo pipefail

cd "$(dirname "$0")/../../.."
WORK=${SMOLLM2_WORK:-$HOME/.cache/cascade/work/smollm2}
SEQUENCES=${SEQUENCES:-20000}
THREADS=${THREADS:-1}
mkdir -p "$WORK"

running() { pgrep -f -- "record --model pulled:smollm2-135m-instruct --out $WORK/record" >/dev/null; }

case "${1:-start}" in
  status)
    if running; then echo "running"; else echo "not running"; fi
    grep shard "$WORK/record.log" 2>/dev/null | tail -n 2 || true
    exit 0 ;;
  stop)
    pkill -f -- "record --model pulled:smollm2-135m-instruct --out $WORK/record" || true
    echo "stopped; re-run $0 to resume"
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

if running; then echo "already running; $0 status"; exit 0; fi
python -c 'import sys; from cascade.cli import main; sys.exit(main())' pull smollm2-135m-instruct
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
nohup nice -n 5 python -c 'import sys; from cascade.cli import main; sys.exit(main())' \
  record --model pulled:smollm2-135m-instruct --out "$WORK/record" --sequences "$SEQUENCES" --batch 48 --threads "$THREADS" \
  >>"$WORK/record.log" 2>&1 &
echo "started (pid $!); $0 status"
