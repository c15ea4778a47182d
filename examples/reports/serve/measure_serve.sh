#!/usr/bin/env bash
# Served cascade vs transformers' own server (issue 15 item 6), side by side in one run:
#   cascade      cascade serve -t topologies/4level.yaml            (the default topology, policy auto)
#   authority    cascade serve ... --policy 'fixed:path=[large]'    (the authority alone, same engine)
#   hf           transformers serve examples/models/large             (the peer, static batching)
#   hf-cb        transformers serve ... --continuous-batching         (the peer, continuous batching)
# each at every concurrency in $CONCS and every temperature in $TEMPS, on the held-out prompts,
# with `cascade bench-serve` (streaming, output tokens from the usage chunk). One server at a
# time on a loopback port, started, measured at every load, stopped. OMP_NUM_THREADS=1 for all.
#
# The peer needs transformers' serving extras: pip install accelerate (and the `transformers
# serve` command's own requirements, which it names when missing).
#
# Defaults are a small run (the 2-core machine is shared); a full run:
#   CONCS="1 4 16" TEMPS="0 0.8" REQUESTS_PER_CLIENT=4 MAX_TOKENS=128 examples/reports/serve/measure_serve.sh
# The preliminary run in README: REQUESTS_PER_CLIENT=1 MAX_TOKENS=48 MAX_SECONDS=180 (then the
# in-process step alone: SERVERS="" with the same MAX_TOKENS).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-examples/reports/serve}
CONCS=${CONCS:-"1 4 16"}
TEMPS=${TEMPS:-"0 0.8"}
REQUESTS_PER_CLIENT=${REQUESTS_PER_CLIENT:-2}   # requests per run = concurrency x this (at least 4)
MAX_TOKENS=${MAX_TOKENS:-64}
SERVERS=${SERVERS-"cascade authority hf hf-cb"}   # set but empty: no server (the in-process step alone)
PORT=${PORT:-8321}
MAX_SECONDS=${MAX_SECONDS:-300}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/runs" "$OUT/logs"

server_cmd() {
  case $1 in
    cascade)   echo cascade serve -t topologies/4level.yaml --host 127.0.0.1 --port "$PORT" --max-num-seqs 16 --log-level warning ;;
    authority) echo cascade serve -t topologies/4level.yaml --host 127.0.0.1 --port "$PORT" --max-num-seqs 16 --log-level warning \
                    --policy 'fixed:path=[large]' ;;
    hf)        echo transformers serve examples/models/large --host 127.0.0.1 --port "$PORT" --device cpu --no-continuous-batching ;;
    hf-cb)     echo transformers serve examples/models/large --host 127.0.0.1 --port "$PORT" --device cpu --continuous-batching ;;
  esac
}

model_of() {  # the model id the server answers to
  case $1 in cascade|authority) echo 4level ;; *) echo examples/models/large ;; esac
}

stop_server() {  # SIGTERM, then SIGKILL after 30 s (transformers serve may linger)
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }; sleep 1; done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

for server in $SERVERS; do
  log="$OUT/logs/$server.log"
  ( eval "exec $(server_cmd "$server")" ) > "$log" 2>&1 &  # eval: the policy spec's quotes
  pid=$!
  trap stop_server EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "$server exited:"; tail -20 "$log"; exit 1; }
    sleep 1
  done
  for temp in $TEMPS; do
    for conc in $CONCS; do
      n=$(( conc * REQUESTS_PER_CLIENT )); (( n < 4 )) && n=4
      name="$server-c$conc-T$temp"
      echo "== $name ($n requests)"
      cascade bench-serve --base-url "http://127.0.0.1:$PORT/v1" --model "$(model_of "$server")" \
        --prompts examples/prompts/heldout.jsonl --concurrency "$conc" --num-requests "$n" \
        --max-tokens "$MAX_TOKENS" --temperature "$temp" --seed 0 --max-seconds "$MAX_SECONDS" \
        --tokenizer examples/models/large --label "$server c=$conc T=$temp" \
        --json "$OUT/runs/$name.json" --plot "$OUT/runs/$name.png" > /dev/null || echo "   ($name: no request completed)"
    done
  done
  stop_server
  trap - EXIT
done

# In-process reference (greedy): Cascade.generate(batch_size=B) and plain batched generate at the
# same concurrencies, the server's own cost being served ÷ in-process.
if [[ ${INPROC:-1} == 1 ]]; then
  echo "== in-process generate(batch_size=B)"
  cascade bench --topology topologies/4level.yaml --prompts examples/prompts/heldout.jsonl \
    --batch-sizes "${CONCS// /,}" --requests 16 --max-new-tokens "$MAX_TOKENS" --repeats 1 \
    --out "$OUT/inproc" --no-progress 2>&1 | grep -v "Loading weights" > "$OUT/inproc.txt"
fi

runs=()  # in the order above: server, temperature, concurrency
for server in $SERVERS; do for temp in $TEMPS; do for conc in $CONCS; do
  [[ -f "$OUT/runs/$server-c$conc-T$temp.json" ]] && runs+=("$OUT/runs/$server-c$conc-T$temp.json")
done; done; done
if (( ${#runs[@]} )); then
  cascade bench-serve --table "${runs[@]}" --markdown "$OUT/table.md" --plot "$OUT/table.png"
fi
