#!/usr/bin/env bash
# The drafters' training stream for SmolLM2-135M-Instruct: record more of the authority's own
# conversations, continue the feature head from the latest checkpoint on everything recorded,
# score it on the repository's fixed held-out set; again, while the stream runs. In the
# background, at low priority (nice 19): it takes the CPU that nothing else wants.
#
#   examples/models/smollm2/stream.sh           # start, or resume where it stopped
#   examples/models/smollm2/stream.sh status    # running or not; the last lines of its log
#   examples/models/smollm2/stream.sh stop      # stop (a training round writes its checkpoint first)
#
# What lasts is in the repository: records/ (every recorded shard's token ids, compressed, written
# by `cascade record --keep`), heldout/ (the fixed held-out set), head/ (the committed head). A
# machine whose cache is gone rebuilds the records from records/ (no generation; a scoring pass
# each only with TOP_K > 0) and goes on. What is recomputed lives in $SMOLLM2_WORK (default
# ~/.cache/cascade/work/smollm2): the shards, the features, checkpoints, and
# stream/head-N, each round's head with its held-out figures (heldout.txt). Commit the best
# one into head/ with its figures in the model card (README.md here).
#
# Each round records ROUND_SEQUENCES more conversations (BATCH at a time, continuous batching:
# docs/real-model.md says which BATCH was fastest where; RECORDERS processes side by side, one a
# core, each its share of the round's shards: `cascade record --first`), as token ids alone
# (TOP_K=0: the head computes its own targets, so no scoring pass; a drafter needs TOP_K=16),
# then trains the head from the previous round's head (the committed one first) over all
# records, PASSES times over them at most and for MINUTES at most, at learning rate LR. Rounds
# record only until the records hold TRAIN_AT tokens: continuing head/ (trained on ~2M tokens) on
# the first 28k-134k recorded tokens did not beat it (the model card's "Ablations", control arm),
# so training on less is CPU spent for nothing.
set -euo pipefail

cd "$(dirname "$0")/../../.."
HERE=examples/models/smollm2
WORK=${SMOLLM2_WORK:-$HOME/.cache/cascade/work/smollm2}
BATCH=${BATCH:-32}
ROUND_SEQUENCES=${ROUND_SEQUENCES:-640}
MINUTES=${MINUTES:-30}
PASSES=${PASSES:-4}
LR=${LR:-3e-4}
TTT=${TTT:-1}  # 2: EAGLE-3's training-time test over 2 draft steps (dearer a step: the model card's Ablations)
TRAIN_AT=${TRAIN_AT:-1000000}
THREADS=${THREADS:-1}
RECORDERS=${RECORDERS:-1}
TOP_K=${TOP_K:-0}
REC=$WORK/record-top$TOP_K
mkdir -p "$WORK/stream" "$HERE/records"

running() { pgrep -f -- "stream.sh run $WORK" >/dev/null; }
cascade() { python -c 'import sys; from cascade.cli import main; sys.exit(main())' "$@"; }

case "${1:-start}" in
  status)
    if running; then echo "running"; else echo "not running"; fi
    tail -n 4 "$WORK/stream.log" 2>/dev/null || true
    exit 0 ;;
  stop)
    pkill -TERM -f -- "stream.sh run $WORK" || true
    pkill -TERM -f -- "--out $WORK/record" || true
    pkill -TERM -f -- "--work-dir $WORK/stream/train" || true
    echo "stopping; re-run $0 to resume"
    exit 0 ;;
  start)
    if running; then echo "already running; $0 status"; exit 0; fi
    cascade pull smollm2-135m-instruct
    export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
    nohup nice -n 19 "$0" run "$WORK" >>"$WORK/stream.log" 2>&1 &
    echo "started (pid $!); $0 status"
    exit 0 ;;
  run) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

while true; do
  kept=$(find "$HERE/records" -name 'shard-*.npz' 2>/dev/null | wc -l)
  round=$(find "$WORK/stream" -maxdepth 1 -name 'head-*' | wc -l)
  if [[ -f "$WORK/stream/train-$((round + 1))/checkpoint.pt" ]]; then
    # a training round was stopped: finish it on the records it began with before recording more
    echo "$(date -u +%FT%TZ) round: resuming head-$((round + 1))'s training"
  else
    share=$(( (ROUND_SEQUENCES / BATCH + RECORDERS - 1) / RECORDERS ))  # shards a recorder
    echo "$(date -u +%FT%TZ) round: $kept shards kept; recording to shard $(( kept + RECORDERS * share ))" \
      "($RECORDERS at once)"
    record() {
      cascade record --model pulled:smollm2-135m-instruct --keep "$HERE/records" --batch "$BATCH" \
        --threads "$THREADS" --top-k "$TOP_K" "$@"
    }
    for (( r = 1; r < RECORDERS; r++ )); do  # the others, each into a folder of its own
      record --out "$REC-$r" --first $(( kept + r * share )) --sequences $(( (kept + (r + 1) * share) * BATCH )) &
    done
    record --out "$REC" --sequences $(( (kept + share) * BATCH ))
    wait
    record --out "$REC" --sequences $(( (kept + RECORDERS * share) * BATCH ))  # takes the others' shards
  fi
  from=$(find "$WORK/stream" -maxdepth 1 -name 'head-*' | sort -V | tail -n 1)
  from=${from:-$HERE/head}
  tokens=$(python -c "import json,sys; print(sum(s['tokens'] for s in json.load(open(sys.argv[1]))['shards'].values()))" "$REC/record.json")
  if (( tokens < TRAIN_AT )); then
    echo "$(date -u +%FT%TZ) $tokens tokens recorded; training waits for $TRAIN_AT (TRAIN_AT)"
    continue
  fi
  steps=$(( tokens * PASSES / 2048 > 50 ? tokens * PASSES / 2048 : 50 ))  # PASSES over the data, 8 x 256 a step
  echo "$(date -u +%FT%TZ) training head-$((round + 1)) from $from: $steps steps over $tokens tokens, at most $MINUTES minutes"
  cascade distill --head --init "$from" --records "$REC" --teacher pulled:smollm2-135m-instruct \
    --out "$WORK/stream/head-$((round + 1))" --steps "$steps" --max-minutes "$MINUTES" --seq-len 256 \
    --batch-size 8 --lr "$LR" --warmup 20 --amp auto --threads "$THREADS" --device cpu \
    --save-dtype bfloat16 --work-dir "$WORK/stream/train-$((round + 1))" --checkpoint-minutes 5 --no-progress \
    --ttt-steps "$TTT"
  python "$HERE/eval_heldout.py" --head --fixed "$WORK/stream/head-$((round + 1))" \
    | tee "$WORK/stream/head-$((round + 1))/heldout.txt"
done
