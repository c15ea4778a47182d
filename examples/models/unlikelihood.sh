#!/usr/bin/env bash
# Stage 2 of the rebuild (issue 18): train the rebuilt `large` away from greedy loops, in the background.
#
#   examples/models/unlikelihood.sh            # start, or resume from the last checkpoint
#   examples/models/unlikelihood.sh status     # is it running; the last lines of its log
#   examples/models/unlikelihood.sh stop       # stop it (it resumes from its last checkpoint)
#
# Maximum likelihood alone left `large` looping under greedy decoding (median repeated-4-gram
# share 0.724 on the held-out prompts). This continues it from its float32 weights
# ($REBUILD_DIR/work/large/final, written by rebuild.sh) with `cascade distill --teacher none
# --init`: every second step is a sequence-level unlikelihood step (cascade/train/unlikelihood.py:
# greedy continuations of corpus prefixes, trained away from their repeated 4-grams), the others
# plain cross-entropy on the same corpus. The result replaces $REBUILD_DIR/family/large; the
# students are not retrained (tiny -> small -> medium never see large; the model card's
# medium -> large acceptance says whether they still follow it). Then land_rebuild.sh as before.
# Checkpoints, resume, THREADS and nice as in rebuild.sh.
set -euo pipefail

cd "$(dirname "$0")/../.."
REBUILD_DIR=${REBUILD_DIR:-/work/family-rebuild}
WORK=$REBUILD_DIR/work/unlikelihood
PIDFILE=$WORK/run.pid
LOG=$WORK/run.log
mkdir -p "$WORK"

running() { [[ -f $PIDFILE ]] && ps -p "$(cat "$PIDFILE")" -o args= 2>/dev/null | grep -qF -- "--work-dir $WORK"; }

case "${1:-start}" in
  status)
    if running; then echo "running (pid $(cat "$PIDFILE"))"; else echo "not running"; fi
    tail -n 5 "$WORK/distill.log" 2>/dev/null || true
    exit 0 ;;
  stop)
    if ! running; then echo "not running"; exit 0; fi
    kill "$(cat "$PIDFILE")"
    for _ in $(seq 300); do running || break; sleep 1; done
    if running; then echo "still saving (pid $(cat "$PIDFILE"))"; else echo "stopped; re-run $0 to resume"; fi
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

if running; then
  echo "already running (pid $(cat "$PIDFILE")); $0 status"
  exit 0
fi
[[ -f $REBUILD_DIR/work/large/final/config.json ]] || {
  echo "$REBUILD_DIR/work/large/final is missing: run examples/models/rebuild.sh first" >&2; exit 1; }

mapfile -t HELDOUT < <(python -c 'from cascade.train.heldout import heldout_files
print("\n".join(map(str, heldout_files())))')

THREADS=${THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
nohup nice -n 19 python -c 'import sys; from cascade.cli import main; sys.exit(main())' distill \
  --teacher none --init "$REBUILD_DIR/work/large/final" \
  --corpus manifest:examples/models/CORPUS.tsv \
  --eval-corpus "${HELDOUT[@]}" \
  --seq-len 256 --batch-size 8 --steps 800 --warmup 20 --lr 3e-4 --seed 7 \
  --unlikelihood-every 2 --rollout-prefix 48 --rollout-tokens 96 \
  --amp bf16 --threads "$THREADS" --device cpu \
  --work-dir "$WORK" --out "$REBUILD_DIR/family/large" --checkpoint-minutes 5 --no-progress \
  >>"$LOG" 2>&1 &
echo $! >"$PIDFILE"
echo "started (pid $!); log: $WORK/distill.log (and $LOG); $0 status"
