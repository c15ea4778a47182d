#!/usr/bin/env bash
# Start, or resume, training a feature head (EAGLE-1) for SmolLM2-135M-Instruct on what record.sh
# recorded, in the background (cascade distill --head: see docs/real-model.md).
#
#   examples/models/smollm2/train-head.sh           # start, or resume where it stopped
#   examples/models/smollm2/train-head.sh status    # running or not; the last lines of its log
#   examples/models/smollm2/train-head.sh stop      # SIGTERM: checkpoint, then exit (re-run to resume)
#
# First the authority computes its features over every recorded conversation, once, into
# $SMOLLM2_WORK (default ~/.cache/cascade/work/smollm2)/record/features (bf16, one file per record
# shard: a stopped run redoes at most the shard in progress; ~1.2 KB a token); then the head
# trains on them (checkpoints, logs: .../head-train) and is saved with its held-out figures
# (training.json) to .../head, which a topology level `kind: head, model: <that folder>,
# features_of: <the authority level>` loads. The head: one decoder layer of the authority's
# width (576, MLP 1536), the authority's frozen LM head over an 8,192-token draft vocabulary
# (the drafters'), bf16. STEPS fixes the cosine schedule: keep it (and the records) unchanged
# across resumes; MINUTES caps the training time (the schedule then follows time).
#
# Sized by measurement: the defaults (MINUTES=56, the schedule following time) trained the
# shipped head, ~4.6 passes over 1.95M training tokens, on a CPU with native bf16 (the run and
# its rates: the model card, README.md here); on an AVX2-only CPU in float32 both the features
# and the training are several times slower (docs/results-log.md).
set -euo pipefail

cd "$(dirname "$0")/../../.."
WORK=${SMOLLM2_WORK:-$HOME/.cache/cascade/work/smollm2}
STEPS=${STEPS:-100000}
WARMUP=${WARMUP:-60}
MINUTES=${MINUTES:-56}
NOISE=${NOISE:-0}
THREADS=${THREADS:-1}
mkdir -p "$WORK/head-train"

running() { pgrep -f -- "--work-dir $WORK/head-train" >/dev/null; }

case "${1:-start}" in
  status)
    if running; then echo "running"; else echo "not running"; fi
    tail -n 3 "$WORK/head-train/distill.log" 2>/dev/null || true
    exit 0 ;;
  stop)
    pkill -TERM -f -- "--work-dir $WORK/head-train" || true
    echo "stopping (in training a checkpoint is written first; features: the shard in progress is redone); re-run $0 to resume"
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

if running; then echo "already running; $0 status"; exit 0; fi
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
nohup nice -n 19 python -c 'import sys; from cascade.cli import main; sys.exit(main())' distill --head \
  --records "$WORK/record" --teacher pulled:smollm2-135m-instruct --draft-vocab 8192 --out "$WORK/head" \
  --steps "$STEPS" ${MINUTES:+--max-minutes "$MINUTES"} --seq-len 256 --batch-size 8 --lr 1e-3 --warmup "$WARMUP" \
  --feature-noise "$NOISE" --amp auto --threads "$THREADS" --device cpu --save-dtype bfloat16 \
  --work-dir "$WORK/head-train" --checkpoint-minutes 5 --no-progress \
  >>"$WORK/head-train.log" 2>&1 &
echo "started (pid $!); $0 status"
