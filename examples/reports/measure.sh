#!/usr/bin/env bash
# The measurements behind the README's figures and docs/benchmarks.md (run from the repo root).
#
#   examples/reports/measure.sh                 # every part, in this order (about an hour)
#   examples/reports/measure.sh demo bench      # some parts: demo ab bench batch batch-long lean headroom
#
# One thread for torch (OMP_NUM_THREADS=1): small-tensor work is ~10x slower when the other core is busy.
set -o pipefail
export OMP_NUM_THREADS=1
R=examples/reports
mkdir -p $R
quiet() { grep -v "Loading weights"; }

demo() {
  /usr/bin/time -f "demo wall %e s" cascade demo 2>&1 | quiet > $R/demo.txt
}

ab() {  # the best fixed lookahead (tuned on the tuning prompts) against auto, greedy and at T = 0.8
  cascade tune --topology topologies/4level.yaml --prompts examples/prompts/tuning.jsonl --num-prompts 12 \
      --max-new-tokens 64 --passes 1 --path tiny,large --out $R/tune-tiny-large.json 2>&1 | quiet | tail -3 > $R/tune.txt
  BEST=$(python -c "import json; print(json.load(open('$R/tune-tiny-large.json'))['policy'])")
  echo "best fixed: $BEST" >> $R/tune.txt
  cascade ab --topology topologies/4level.yaml --a "$BEST" --b auto --prompts examples/prompts/heldout.jsonl \
      --max-new-tokens 96 --repeats 2 --out $R/ab-auto-vs-best-fixed --no-progress 2>&1 | quiet > $R/ab.txt
  # the fixed policy on the hierarchy itself: its default path (the chain), lookahead tuned per edge
  cascade tune --topology topologies/4level.yaml --prompts examples/prompts/tuning.jsonl --num-prompts 12 \
      --max-new-tokens 64 --passes 2 --out $R/tune-chain.json 2>&1 | quiet | tail -5 > $R/tune-chain.txt
  CHAIN=$(python -c "import json; print(json.load(open('$R/tune-chain.json'))['policy'])")
  echo "best fixed on the chain: $CHAIN" >> $R/tune-chain.txt
  cascade ab --topology topologies/4level.yaml --a "$CHAIN" --b auto --prompts examples/prompts/heldout.jsonl \
      --max-new-tokens 96 --repeats 2 --out $R/ab-auto-vs-chain-fixed --no-progress 2>&1 | quiet > $R/ab-chain.txt
  # both A/Bs again under sampling (T = 0.8; the fixed lookaheads as tuned under greedy decoding)
  cascade ab --topology topologies/4level.yaml --a "$CHAIN" --b auto --prompts examples/prompts/heldout.jsonl \
      --max-new-tokens 96 --repeats 2 --temperature 0.8 --out $R/ab-auto-vs-chain-fixed-t08 --no-progress 2>&1 \
      | quiet > $R/ab-chain-t08.txt
  cascade ab --topology topologies/4level.yaml --a "$BEST" --b auto --prompts examples/prompts/heldout.jsonl \
      --max-new-tokens 96 --repeats 2 --temperature 0.8 --out $R/ab-auto-vs-best-fixed-t08 --no-progress 2>&1 \
      | quiet > $R/ab-t08.txt
}

bench() {
  # the configurations side by side, greedy and sampled (T = 0.8, top-p 0.95) interleaved in one run, with the
  # repetition of every configuration's text and the distribution check at T = 0.8 (exit status 2 on a failure);
  # short (10 prompts x 64 tokens): the machine is shared
  cascade bench --topology topologies/4level.yaml --prompts examples/prompts/heldout.jsonl --num-prompts 10 \
      --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --with-greedy --out $R/bench --no-progress 2>&1 \
      | quiet > $R/bench.txt
}

batch() {  # under load, greedy and sampled: the same 8 requests served B at a time, 2 side-by-side repeats
  local pair="--topology topologies/4level.yaml --batch-sizes 1,4 --max-new-tokens 64 --requests 8 --repeats 2"
  cascade bench $pair --out $R/batch --no-progress 2>&1 | quiet > $R/batch.txt
  cascade bench $pair --temperature 0.8 --top-p 0.95 --out $R/batch-t08 --no-progress 2>&1 | quiet > $R/batch-t08.txt
}

batch-long() {  # the longer greedy runs under load (up to B = 64, 32 requests of 128 tokens)
  local long="--topology topologies/4level.yaml --batch-sizes 1,4,16,64 --max-new-tokens 128 --requests 32 --repeats 2"
  cascade bench $long --out $R/batch-long --no-progress 2>&1 | quiet > $R/batch-long.txt
  # the target concurrency (B = 4) again, with 6 side-by-side repeats: the machine's noise is ~±5% per repeat
  cascade bench --topology topologies/4level.yaml --batch-sizes 4 --max-new-tokens 128 --requests 32 --repeats 6 \
      --out $R/batch4-6repeats --no-progress 2>&1 | quiet > $R/batch4-6repeats.txt
  cascade bench $long --policy 'fixed:path=[large]' --out $R/batch-authority-alone --no-progress 2>&1 \
      | quiet > $R/batch-authority-alone.txt
  cascade bench $long --policy 'fixed:lookahead={tiny: 4},path=[tiny, large]' --out $R/batch-fixed-tiny4 \
      --no-progress 2>&1 | quiet > $R/batch-fixed-tiny4.txt
}

lean() {  # the worker's lean forward against transformers' forward, per pass, on every level
  python examples/reports/lean_forward.py 2>&1 | quiet > $R/lean_forward.md
}

headroom() {  # what any lookahead rule could gain over the best fixed one on tiny -> large (replay + oracle)
  mkdir -p $R/headroom
  python examples/reports/headroom.py --drafter examples/models/tiny --verifier examples/models/large \
      --prompts examples/prompts/tuning.jsonl --num-prompts 24 --out $R/headroom/tiny-large.json 2>&1 \
      | quiet > $R/headroom/tiny-large.md
}

PARTS=("$@")
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(demo ab bench batch batch-long lean headroom)
for part in "${PARTS[@]}"; do
  case $part in
    demo|ab|bench|batch|batch-long|lean|headroom) ;;
    *) echo "measure.sh: unknown part '$part' (demo ab bench batch batch-long lean headroom)" >&2; exit 2 ;;
  esac
done
for part in "${PARTS[@]}"; do
  echo "$(date -u +%H:%M:%S) $part"
  "$part" || echo "$part: exit status $?"
done
echo "$(date -u +%H:%M:%S) done"
