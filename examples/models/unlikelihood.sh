#!/usr/bin/env bash
# Stage 2 of the rebuild (issue 18): train the rebuilt `large` away from greedy loops, in the background.
#
#   examples/models/unlikelihood.sh            # start, or resume from the last checkpoint
#   examples/models/unlikelihood.sh status     # is it running; the last lines of its log
#   examples/models/unlikelihood.sh stop       # stop it (it resumes from its last checkpoint)
#
# Maximum likelihood alone left `large` looping under greedy decoding (median repeated-4-gram
# share 0.724 on the held-out prompts). Two `cascade distill` runs, after rebuild.sh:
#  (a) `large` continued from its float32 weights ($REBUILD_DIR/work/large/final) with
#      `--teacher none --init`: every second step a sequence-level unlikelihood step
#      (cascade/train/unlikelihood.py: greedy continuations of corpus prefixes, trained away from
#      their repeated 4-grams), the others plain cross-entropy on the same corpus;
#  (b) tiny, small and medium continued from rebuild.sh's, distilled from the new `large` (they
#      imitated the looping one: medium -> large acceptance fell to 0.57 after (a) alone).
# Both replace their levels in $REBUILD_DIR/family; then land_rebuild.sh as before. Checkpoints,
# resume, THREADS and nice as in rebuild.sh; a finished stage leaves WORK/<stage>.done.
set -euo pipefail

cd "$(dirname "$0")/../.."
REBUILD_DIR=${REBUILD_DIR:-/work/family-rebuild}
WORK=$REBUILD_DIR/work/unlikelihood
PIDFILE=$WORK/run.pid
LOG=$WORK/run.log
mkdir -p "$WORK"

running() { [[ -f $PIDFILE ]] && ps -p "$(cat "$PIDFILE")" -o args= 2>/dev/null | grep -qF "unlikelihood.sh"; }

case "${1:-start}" in
  status)
    if running; then echo "running (pid $(cat "$PIDFILE"))"; else echo "not running"; fi
    tail -n 3 "$WORK/distill.log" "$WORK/students/distill.log" 2>/dev/null || true
    exit 0 ;;
  stop)
    if ! running; then echo "not running"; exit 0; fi
    pkill -TERM -P "$(cat "$PIDFILE")"  # the training process: it checkpoints, then the script ends
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

# the corpus tokens rebuild.sh cached (the same files and tokenizer): no second tokenization
mkdir -p "$WORK/students"
for f in "$REBUILD_DIR"/work/tokens-*.pt; do
  [[ -e $f ]] && ln -sf "$f" "$WORK/" && ln -sf "$f" "$WORK/students/"
done

mapfile -t HELDOUT < <(python -c 'from cascade.train.heldout import heldout_files
print("\n".join(map(str, heldout_files())))')

THREADS=${THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
FAMILY=$REBUILD_DIR/family
# `cascade distill`, through the package; each command resumes from its checkpoint, or is skipped once done
distill() { nice -n 19 python -c 'import sys; from cascade.cli import main; sys.exit(main())' distill "$@" \
  --corpus manifest:examples/models/CORPUS.tsv --eval-corpus "${HELDOUT[@]}" --seq-len 256 --batch-size 8 \
  --amp bf16 --threads "$THREADS" --device cpu --checkpoint-minutes 5 --no-progress; }
stages() {
  # (a) large: cross-entropy, every second step an unlikelihood step
  [[ -f $WORK/large.done ]] || {
    distill --teacher none --init "$REBUILD_DIR/work/large/final" --steps 800 --warmup 20 --lr 3e-4 --seed 7 \
      --unlikelihood-every 2 --rollout-prefix 48 --rollout-tokens 96 --work-dir "$WORK" --out "$FAMILY/large" \
      && grep -q "saved final" "$WORK/distill.log" && touch "$WORK/large.done"; } || return 0
  # (b) the students, continued from rebuild.sh's (copied before they are replaced), distilled from the
  # new large (pure KL, one teacher forward per batch shared by the three): they imitate the looping one
  for lv in tiny small medium; do
    [[ -d $WORK/students-init/$lv ]] || { mkdir -p "$WORK/students-init" && cp -r "$FAMILY/$lv" "$WORK/students-init/"; }
  done
  [[ -f $WORK/students.done ]] || {
    distill --teacher "$FAMILY/large" --kl-weight 1.0 --steps 600 --warmup 30 --lr 1e-3 --seed 8 \
      --init "$WORK/students-init/tiny" --init "$WORK/students-init/small" \
      --init "$WORK/students-init/medium" --work-dir "$WORK/students" \
      --out "$FAMILY/tiny" --out "$FAMILY/small" --out "$FAMILY/medium" \
      && grep -q "saved medium" "$WORK/students/distill.log" && touch "$WORK/students.done"; } || return 0
}
stages >>"$LOG" 2>&1 &
echo $! >"$PIDFILE"
echo "started (pid $!); logs: $WORK/distill.log, $WORK/students/distill.log (and $LOG); $0 status"
