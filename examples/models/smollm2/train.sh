#!/usr/bin/env bash
# Start, or resume, training SmolLM2-135M-Instruct's drafters on what record.sh recorded, in the
# background: two students in one run, sharing each batch (cascade distill --records).
#
#   examples/models/smollm2/train.sh           # start, or resume from the last checkpoint
#   examples/models/smollm2/train.sh status    # running or not; the last lines of its log
#   examples/models/smollm2/train.sh stop      # SIGTERM: checkpoint, then exit (re-run to resume)
#
# Students (sized by measurement, see docs/real-model.md): draft-s 2x256 and draft-m 2x384,
# both over an 8,192-token draft vocabulary. Checkpoints, logs and the finished students go to
# $SMOLLM2_WORK (default ~/.cache/cascade/work/smollm2)/train and .../drafters. STEPS fixes the
# cosine schedule: keep it (and the records) unchanged across resumes; MINUTES caps the training
# time (the schedule then follows time). The defaults trained the shipped drafters (the run:
# the model card, README.md here).
set -euo pipefail

cd "$(dirname "$0")/../../.."
WORK=${SMOLLM2_WORK:-$HOME/.cache/cascade/work/smollm2}
STEPS=${STEPS:-100000}
MINUTES=${MINUTES:-85}
WARMUP=${WARMUP:-30}
THREADS=${THREADS:-1}
mkdir -p "$WORK/train"

running() { pgrep -f -- "--work-dir $WORK/train" >/dev/null; }

case "${1:-start}" in
  status)
    if running; then echo "running"; else echo "not running"; fi
    tail -n 3 "$WORK/train/distill.log" 2>/dev/null || true
    exit 0 ;;
  stop)
    pkill -TERM -f -- "--work-dir $WORK/train" || true
    echo "stopping (a checkpoint is written first); re-run $0 to resume"
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

if running; then echo "already running; $0 status"; exit 0; fi
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
nohup nice -n 19 python -c 'import sys; from cascade.cli import main; sys.exit(main())' distill \
  --records "$WORK/record" --draft-vocab 8192 \
  --size 2x256 --out "$WORK/drafters/draft-s" --size 2x384 --out "$WORK/drafters/draft-m" \
  --steps "$STEPS" ${MINUTES:+--max-minutes "$MINUTES"} --seq-len 256 --batch-size 8 --lr 2e-3 --warmup "$WARMUP" \
  --amp auto --threads "$THREADS" --device cpu --save-dtype bfloat16 \
  --work-dir "$WORK/train" --checkpoint-minutes 5 --no-progress \
  >>"$WORK/train.log" 2>&1 &
echo "started (pid $!); $0 status"
