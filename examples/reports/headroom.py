"""How much can *any* lookahead policy gain over the best fixed lookahead on a 2-level path?

Replays greedy decoding offline: the verifier's own greedy continuation of each prompt is the
text; the drafter, teacher-forced on it, gives at every position its probability of its own
greedy token and whether that token matches (= would be accepted). Forward-pass costs are
measured on this machine (drafter: one drafted token through ``Worker.draft``; verifier: one
pass scoring w positions, w = 1..33). Then each rule is simulated on the same text:

- fixed k (1..32);
- a calibrated stop (stop when the estimated probability that the whole block is accepted,
  from the measured acceptance per confidence bin, falls below a threshold), the rule `auto`
  uses, with its table fitted in-sample (an upper bound for the online version), best over
  thresholds and caps;
- an oracle that knows how many drafts will be accepted and drafts exactly those (no rule that
  sees only the drafter can do better with a single chain of drafts);
- a small tree instead of a chain: k drafts plus, at each position, the drafter's second choice
  as a leaf (one verifier pass of width 2k + 1; a leaf that is the verifier's token adds one).

Usage (from the repository root; OMP_NUM_THREADS=1 for stable timings):

    OMP_NUM_THREADS=1 python examples/reports/headroom.py --drafter examples/models/tiny \
        --verifier examples/models/large --prompts examples/prompts/tuning.jsonl --num-prompts 24
"""
from __future__ import annotations

import argparse
import bisect
import json
import time

import torch


def replay(drafter, verifier, tok, prompts, max_new_tokens):
    """Per prompt: [(drafter's probability of its greedy token, it matches the verifier's,
    the drafter's second choice matches), ...]."""
    rows = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            out = verifier.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            target = out[0, ids.shape[1]:].tolist()
            probs = torch.softmax(drafter(out).logits[0].float(), -1)[ids.shape[1] - 1:-1]
            top = probs.topk(2, -1)
            rows.append([(float(top.values[j, 0]), int(top.indices[j, 0]) == target[j],
                          int(top.indices[j, 1]) == target[j]) for j in range(len(target))])
    return rows


def pass_costs(drafter, verifier, tok, prompt):
    """Median seconds: one drafted token (drafter), one verifier pass per width 1..33."""
    from cascade.sampling import Sampling
    from workers.hf import HFWorker

    d, v = HFWorker(drafter), HFWorker(verifier)
    ids = tok(prompt).input_ids
    greedy = Sampling(temperature=0.0)
    per_token = []
    for rep in range(20):
        t0 = time.perf_counter()
        d.draft(["s"], [ids + [5] * rep], [8], greedy, [torch.rand(8, dtype=torch.float64)])
        per_token.append((time.perf_counter() - t0) / 8)
    d.release(["s"])
    widths = {}
    for w in range(1, 34):
        ts = []
        for rep in range(9):
            seq = ids + [5] * (rep * w + w)
            t0 = time.perf_counter()
            v.score(["s"], [seq], [w])
            ts.append(time.perf_counter() - t0)
        v.release(["s"])
        widths[w] = sorted(ts)[len(ts) // 2]
    return sorted(per_token)[len(per_token) // 2], widths


BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _rate(rows, step):
    """Tokens per second over the texts, one ``step(text, t) -> (seconds, tokens)`` at a time."""
    seconds = tokens = 0.0
    for text in rows:
        t = 0
        while t < len(text):
            spent, got = step(text, t)
            seconds, tokens, t = seconds + spent, tokens + got, t + got
    return tokens / seconds


def simulate(rows, draft_cost, verify_cost, rule, cap):
    """Tokens per second of a rule: ``rule(j, prob, survival_state)`` -> (stop, state)."""
    def step(text, t):
        k, accepted, state = 0, None, None
        while k < cap and t + k < len(text) - 1:
            prob, match, _ = text[t + k]
            k += 1
            if accepted is None and not match:
                accepted = k - 1
            stop, state = rule(k - 1, prob, state)
            if stop:
                break
        accepted = k if accepted is None else accepted
        return k * draft_cost + verify_cost[min(k + 1, max(verify_cost))], accepted + 1
    return _rate(rows, step)


def _accepted_run(text, t, cap):
    """How many of the drafter's greedy tokens from position t the verifier accepts (at most cap)."""
    run = 0
    while run < cap and t + run < len(text) - 1 and text[t + run][1]:
        run += 1
    return run


def oracle(rows, draft_cost, verify_cost, cap):
    def step(text, t):
        run = _accepted_run(text, t, cap)
        return run * draft_cost + verify_cost[min(run + 1, max(verify_cost))], run + 1
    return _rate(rows, step)


def leaves(rows, draft_cost, verify_cost, k):
    """k drafts and a second-choice leaf at each of their positions, verified in one pass."""
    def step(text, t):
        run = _accepted_run(text, t, k)
        leaf = int(run < k and t + run < len(text) - 1 and text[t + run][2])
        return k * draft_cost + verify_cost[min(2 * k + 1, max(verify_cost))], run + 1 + leaf
    return _rate(rows, step)


def calibration(rows):
    """In-sample acceptance per confidence bin: for a block's first token, and for later ones."""
    counts = [[[0, 0] for _ in BINS] for _ in range(2)]
    for text in rows:
        for j, (prob, match, _) in enumerate(text):
            later = 1 if j and text[j - 1][1] else 0
            c = counts[later][bisect.bisect_right(BINS, prob) - 1]
            c[0] += 1
            c[1] += match
    return [[(a + 1.4) / (n + 2) for n, a in table] for table in counts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the table and figures as JSON here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade.tools.baselines import load_prompts

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.verifier)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    drafter, verifier = load(args.drafter), load(args.verifier)
    prompts = load_prompts(args.prompts, args.num_prompts)
    rows = replay(drafter, verifier, tok, prompts, args.max_new_tokens)
    draft_cost, verify_cost = pass_costs(drafter, verifier, tok, prompts[0])
    plain = 1.0 / verify_cost[1]

    fixed = {k: simulate(rows, draft_cost, verify_cost, lambda j, p, s: (False, s), k) for k in range(1, 33)}
    best_k = max(range(1, 9), key=fixed.get)
    best_fixed = fixed[best_k]
    first, later = calibration(rows)

    def calibrated(threshold):
        def rule(j, prob, survival):
            table = first if j == 0 else later
            survival = (1.0 if survival is None else survival) * table[bisect.bisect_right(BINS, prob) - 1]
            return survival < threshold, survival
        return rule

    stops = {(th, cap): simulate(rows, draft_cost, verify_cost, calibrated(th), cap)
             for th in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5) for cap in (8, 16, 32)}
    best_stop = max(stops, key=stops.get)
    oracles = {cap: oracle(rows, draft_cost, verify_cost, cap) for cap in (8, 32)}
    trees = {k: leaves(rows, draft_cost, verify_cost, k) for k in range(1, 9)}
    best_tree = max(trees, key=trees.get)
    matches = [m for text in rows for _, m, _ in text]
    seconds = [m for text in rows for _, _, m in text]

    lines = [
        f"Drafter `{args.drafter}`, verifier `{args.verifier}`, {len(prompts)} prompts x {args.max_new_tokens} "
        f"greedy tokens; drafter acceptance (teacher-forced) {sum(matches) / len(matches):.3f} (its second "
        f"choice is the verifier's token at {sum(seconds) / len(seconds):.3f} of positions); measured "
        f"costs: drafted token {draft_cost * 1e3:.2f} ms, verifier pass {verify_cost[1] * 1e3:.2f} ms (1 position), "
        f"{verify_cost[9] * 1e3:.2f} ms (9), {verify_cost[33] * 1e3:.2f} ms (33). Engine overhead per step not "
        "included (the same for every rule).",
        "",
        "| rule | simulated tokens/s | vs plain | vs best fixed (k <= 8) |",
        "|---|---:|---:|---:|",
    ]
    row = lambda name, v: lines.append(f"| {name} | {v:.1f} | {v / plain:.2f}x | {v / best_fixed:.3f} |")  # noqa: E731
    for k in sorted({1, 2, 4, best_k, 8, 16, 32}):
        row(f"fixed k={k}" + (" (best k <= 8)" if k == best_k else ""), fixed[k])
    row(f"calibrated stop, threshold {best_stop[0]}, cap {best_stop[1]} (in-sample table)", stops[best_stop])
    for cap, v in oracles.items():
        row(f"oracle (knows the accepted run), cap {cap}", v)
    row(f"tree: k={best_tree} drafts + a second-choice leaf at each (best k <= 8)", trees[best_tree])
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"markdown": "\n".join(lines), "fixed": fixed, "best_fixed_k": best_k,
                       "calibrated_stop": {f"{th}/{cap}": v for (th, cap), v in stops.items()},
                       "oracle": oracles, "tree": trees, "draft_cost": draft_cost, "verify_cost": verify_cost}, f, indent=1)


if __name__ == "__main__":
    main()
