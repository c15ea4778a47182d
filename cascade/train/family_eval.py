"""``cascade model-card``: measure a model family (the numbers in ``examples/models/README.md``).

For a directory holding ``tiny/ small/ medium/ large/`` (or any ``--levels``) it measures, in one
run and side by side:

* size: parameters, MiB of weights on disk, layers/width, training tokens and time
  (from each model's ``training.json``);
* held-out loss and perplexity (nats/token, float32) on evenly spaced 256-token windows of the
  held-out code (:mod:`cascade.train.heldout`: networkx + attrs, never seen in training);
* per-token decode cost: batch 1, float32, KV cache, 64 decode steps after a 32-token prefill,
  models interleaved round-robin so that background load hits all of them alike; the median
  over rounds is reported, with its ratio to the first (smallest) level;
* acceptance matrix on the held-out prompts: for each prompt the verifier generates N=64 tokens
  greedily; the drafter is teacher-forced on the same sequence; greedy acceptance is the
  fraction of generated positions where the drafter's argmax equals the verifier's; at
  temperature T it is the mean over positions of ``sum_v min(p_draft(v), p_verifier(v))`` with
  both softmaxed at T (the expected speculative-sampling acceptance rate);
* text: every level's greedy continuations of the held-out prompts (``--text-tokens``, 96) and
  their median repeated-4-gram share (:mod:`cascade.repetition`), and a few of the top
  level's sampled continuations (T, fixed seed), shown as they are;
* targets: the family's targets (:data:`TARGETS`), each met or missed, with the figure.

Held-out loss is also given per character of held-out text, which compares across tokenizers.

Usage::

    cascade model-card examples/models --json examples/models/metrics.json \\
        --markdown examples/models/measurements.md
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

DEFAULT_LEVELS = ("tiny", "small", "medium", "large")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "model-card",
        help="measure a model family: sizes, held-out loss, decode cost, acceptance matrix",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("family", nargs="?", default="examples/models", help="directory with one sub-directory per level")
    p.add_argument("--levels", nargs="+", default=list(DEFAULT_LEVELS), help="levels, smallest first")
    p.add_argument("--prompts", default="examples/prompts/heldout.jsonl", help="held-out prompts (JSONL, 'prompt' field)")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt by the verifier")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature for the sampled acceptance")
    p.add_argument("--loss-windows", type=int, default=64, help="256-token held-out windows for the loss")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--decode-rounds", type=int, default=7, help="round-robin timing rounds")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps per timing round")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--text-tokens", type=int, default=96, help="tokens per greedy / sampled continuation (text)")
    p.add_argument("--samples", type=int, default=3, help="sampled continuations of the top level to show")
    p.add_argument("--skip", nargs="*", default=[], choices=["loss", "decode", "acceptance", "text"],
                   help="parts to skip")
    p.add_argument("--json", dest="json_out", default=None, help="write all measurements as JSON here")
    p.add_argument("--markdown", default=None, help="write the markdown tables here")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- loading


def load_family(family: str | Path, levels, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = Path(family)
    models, meta = {}, {}
    for lv in levels:
        d = family / lv
        models[lv] = AutoModelForCausalLM.from_pretrained(d, dtype=dtype or torch.float32).eval()
        info = {}
        if (d / "training.json").exists():
            info = json.loads((d / "training.json").read_text())
        weights = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        cfg = models[lv].config
        info.update({
            "params": sum(p.numel() for p in models[lv].parameters()),
            "weights_mib": weights / 2**20,
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "intermediate": cfg.intermediate_size,
        })
        meta[lv] = info
    tokenizer = AutoTokenizer.from_pretrained(family / levels[-1])
    return models, tokenizer, meta


def shared_tokenizer(family: str | Path, levels) -> bool:
    """Whether every level's directory holds the same tokenizer (tokenizer.json byte for byte)."""
    files = {(Path(family) / lv / "tokenizer.json").read_bytes() for lv in levels}
    return len(files) == 1


# --------------------------------------------------------------------------- held-out loss


def spread_windows(data, seq_len: int, n: int):
    """``n`` windows of ``seq_len + 1`` tokens spread evenly over ``data`` (non-overlapping if possible)."""
    import torch

    span = seq_len + 1
    last = data.numel() - span
    if last < 0:
        raise ValueError("held-out text too short")
    count = max(1, min(n, last // span + 1))
    starts = [round(i * last / max(1, count - 1)) for i in range(count)] if count > 1 else [0]
    return torch.stack([data[s : s + span] for s in starts]).long()


def heldout_windows(tokenizer, seq_len: int = 256, n: int = 64, text: str | None = None):
    import torch

    from cascade.train.heldout import heldout_text

    text = heldout_text() if text is None else text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return spread_windows(torch.tensor(ids, dtype=torch.long), seq_len, n)


def predicted_chars(tokenizer, windows) -> int:
    """Characters of the text the windows' predicted tokens (all but each window's first) decode to."""
    return sum(len(tokenizer.decode(w)) for w in windows[:, 1:])


def nats_per_char(loss: float, tokenizer, windows, chars: int | None = None) -> float:
    """A held-out loss in nats per token, as nats per character of the text the windows'
    predicted tokens decode to (``chars``: :func:`predicted_chars`, when already counted):
    comparable across tokenizers."""
    chars = predicted_chars(tokenizer, windows) if chars is None else chars
    return loss * windows[:, 1:].numel() / chars


def heldout_losses(models: dict, windows) -> dict:
    from cascade.train.trainer import eval_loss

    return {lv: eval_loss(m, windows) for lv, m in models.items()}


# --------------------------------------------------------------------------- decode cost


def _cache_kwarg() -> str:
    """Name of the KV-cache argument of ``forward`` (``cache`` in transformers >= 5.2x, else
    ``past_key_values``)."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def decode_costs(models: dict, vocab: int, rounds: int = 7, steps: int = 64, prefill: int = 32, seed: int = 0) -> dict:
    """Median ms per one-token decode step (batch 1, KV cache), models interleaved per round."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, prefill), generator=g)
    times = {lv: [] for lv in models}
    kw = _cache_kwarg()

    def one(model):
        with torch.inference_mode():
            out = model(input_ids=prompt, use_cache=True)
            cache = _out_cache(out)
            tok = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok, use_cache=True, **{kw: cache})
                cache = _out_cache(out)
                tok = out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - t0) / steps * 1000

    for m in models.values():  # warm-up
        one(m)
    for _ in range(rounds):
        for lv, m in models.items():
            times[lv].append(one(m))
    return {lv: statistics.median(ts) for lv, ts in times.items()}


# --------------------------------------------------------------------------- acceptance


def greedy_continuations(model, tokenizer, prompts, new_tokens: int = 64):
    """For each prompt: (prompt_ids, generated_ids) with greedy decoding by ``model``."""
    import torch

    out = []
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        for text in prompts:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
            out.append((ids[0], gen[0, ids.size(1):]))
    return out


def position_logits(model, prompt_ids, gen_ids):
    """Logits (float32) predicting each generated token, teacher-forced: shape [len(gen), V]."""
    import torch

    seq = torch.cat([prompt_ids, gen_ids]).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=seq[:, :-1]).logits[0].float()
    p = prompt_ids.numel()
    return logits[p - 1 : p - 1 + gen_ids.numel()]


def acceptance_stats(draft_logits, verify_logits, temperature: float) -> tuple[float, float, int]:
    """(greedy matches, sum over positions of sum_v min(p_d, p_v) at T, positions)."""
    import torch

    greedy = (draft_logits.argmax(-1) == verify_logits.argmax(-1)).sum().item()
    pd = torch.softmax(draft_logits / temperature, -1)
    pv = torch.softmax(verify_logits / temperature, -1)
    sampled = torch.minimum(pd, pv).sum(-1).sum().item()
    return greedy, sampled, draft_logits.size(0)


def acceptance_matrix(models: dict, tokenizer, prompts, new_tokens: int = 64, temperature: float = 0.8):
    """{"greedy": {drafter: {verifier: rate}}, "sampled": ..., "positions": {verifier: n}}."""
    levels = list(models)
    greedy = {d: {} for d in levels}
    sampled = {d: {} for d in levels}
    positions = {}
    for v in levels:
        conts = greedy_continuations(models[v], tokenizer, prompts, new_tokens)
        conts = [(p, g) for p, g in conts if g.numel() > 0]
        v_logits = [position_logits(models[v], p, g) for p, g in conts]
        positions[v] = sum(x.size(0) for x in v_logits)
        for d in levels:
            tot_g = tot_s = n = 0
            for (p, g), vl in zip(conts, v_logits):
                dl = vl if d == v else position_logits(models[d], p, g)
                a, b, c = acceptance_stats(dl, vl, temperature)
                tot_g, tot_s, n = tot_g + a, tot_s + b, n + c
            greedy[d][v] = tot_g / max(1, n)
            sampled[d][v] = tot_s / max(1, n)
    return {"greedy": greedy, "sampled": sampled, "positions": positions, "temperature": temperature,
            "new_tokens": new_tokens, "prompts": len(prompts)}


# --------------------------------------------------------------------------- text


def sampled_continuations(model, tokenizer, prompts, new_tokens: int, temperature: float, seed: int = 0):
    """Continuations sampled at ``temperature`` (no top-k / top-p), seeded per prompt: texts."""
    import torch

    eos = tokenizer.eos_token_id
    out = []
    with torch.inference_mode():
        for i, text in enumerate(prompts):
            torch.manual_seed(seed + i)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=eos)
            out.append(tokenizer.decode(gen[0, ids.size(1):]))
    return out


def text_quality(models: dict, tokenizer, prompts, new_tokens: int = 96, temperature: float = 0.8,
                 samples: int = 3) -> dict:
    """Per level, the median repeated-4-gram share of its greedy continuations and the share
    of them that loop; the top level's first ``samples`` sampled continuations."""
    from cascade.repetition import LOOP_THRESHOLD, is_loop, median_repetition

    top = list(models)[-1]
    out = {"new_tokens": new_tokens, "prompts": len(prompts), "loop_threshold": LOOP_THRESHOLD,
           "greedy_repetition_median": {}, "greedy_loop_share": {}}
    for lv, model in models.items():
        conts = [g.tolist() for _, g in greedy_continuations(model, tokenizer, prompts, new_tokens)]
        out["greedy_repetition_median"][lv] = median_repetition(conts)
        out["greedy_loop_share"][lv] = sum(map(is_loop, conts)) / max(1, len(conts))
    shown = prompts[:samples]
    out["samples"] = {"level": top, "temperature": temperature, "prompts": shown,
                      "texts": sampled_continuations(models[top], tokenizer, shown, new_tokens, temperature)}
    return out


# --------------------------------------------------------------------------- targets

#: the family's targets (issue 18): (key, description)
TARGETS = (
    ("loss_order", "held-out loss strictly decreases tiny -> small -> medium -> large"),
    ("loss_margin_medium", "large at least 0.10 nats/token below medium"),
    ("loss_margin_tiny", "large at least 0.40 nats/token below tiny"),
    ("repetition", "large's greedy continuations: median repeated-4-gram share <= 0.30"),
    ("weights", "all weights <= 40 MiB"),
    ("tokenizer", "one tokenizer shared by every level"),
    ("decode_cost", "each level's decode cost >= 2x the level below"),
    ("acceptance_greedy", "adjacent greedy acceptance >= 0.6"),
    ("acceptance_sampled", "adjacent acceptance at T >= 0.6"),
)


def check_targets(results: dict) -> dict:
    """key -> (met, the figure as text), for the targets the measured parts allow."""
    levels, meta, out = results["levels"], results["meta"], {}
    pairs = list(zip(levels, levels[1:]))
    weights = sum(meta[lv]["weights_mib"] for lv in levels)
    out["weights"] = (weights <= 40, f"{weights:.2f} MiB")
    out["tokenizer"] = (results["shared_tokenizer"], "shared" if results["shared_tokenizer"] else "differs")
    if "loss" in results:
        loss = results["loss"]
        out["loss_order"] = (all(loss[a] > loss[b] for a, b in pairs), " > ".join(f"{loss[lv]:.3f}" for lv in levels))
        if len(levels) >= 2:
            top, below, first = levels[-1], levels[-2], levels[0]
            for key, lower, margin in (("loss_margin_medium", below, 0.10), ("loss_margin_tiny", first, 0.40)):
                gap = loss[lower] - loss[top]
                out[key] = (gap >= margin - 1e-9, f"{gap:.3f}")  # a margin met exactly is met
    if "text" in results:
        rep = results["text"]["greedy_repetition_median"][levels[-1]]
        out["repetition"] = (rep <= 0.30, f"{rep:.3f} ({results['text']['new_tokens']} tokens)")
    if "decode_ms" in results:
        ms = results["decode_ms"]
        ratios = [ms[b] / ms[a] for a, b in pairs]
        out["decode_cost"] = (all(r >= 2 for r in ratios), ", ".join(f"{r:.2f}x" for r in ratios))
    if "acceptance" in results:
        acc = results["acceptance"]
        for key, kind in (("acceptance_greedy", "greedy"), ("acceptance_sampled", "sampled")):
            rates = [acc[kind][a][b] for a, b in pairs]
            out[key] = (all(r >= 0.6 for r in rates), ", ".join(f"{r:.3f}" for r in rates))
    return out


# --------------------------------------------------------------------------- report


def _teacher_text(meta: dict) -> str:
    if meta.get("init_training"):  # continued from an earlier model (`cascade distill --init`)
        earlier = _teacher_text(meta["init_training"])
        if meta.get("teacher") is None:
            ul = meta.get("unlikelihood")
            how = "cross-entropy" + (f" with a sequence-level unlikelihood step every {ul['every']}" if ul else "")
            return f"{earlier}, then trained further ({meta.get('steps')} steps, {how})"
        return (f"{earlier}, then distilled further from {meta.get('teacher')} "
                f"({meta.get('steps')} steps, KL weight {meta.get('kl_weight')})")
    text = meta.get("teacher") or "none (cross-entropy)"
    if meta.get("refine"):
        text += f", then refined against {meta['refine'].get('teacher')} ({meta['refine'].get('steps')} steps)"
    return text


def _training_total(meta: dict, key: str):
    """Tokens or seconds of training, summed over the models a model was initialised from."""
    value = meta.get(key)
    if value is None:
        return None
    earlier = _training_total(meta["init_training"], key) if meta.get("init_training") else 0
    return value + (earlier or 0)


def markdown(results: dict) -> str:
    levels = results["levels"]
    meta = results["meta"]
    lines = ["### Sizes and training", "",
             "| level | layers x width (heads, FFN) | params | weights (MiB) | training tokens | tokens/param "
             "| training time | teacher |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for lv in levels:
        m = meta[lv]
        tt = _training_total(m, "train_tokens")
        ts = _training_total(m, "train_seconds")
        params = m["params"]
        lines.append(f"| {lv} | {m['layers']} x {m['hidden']} ({m['heads']}, {m['intermediate']}) | {m['params']:,} "
                     f"| {m['weights_mib']:.2f} | {f'{tt / 1e6:.2f} M' if tt else '?'} "
                     f"| {f'{tt / params:.2f}' if tt else '?'} "
                     f"| {f'{ts / 60:.1f} min' if ts else '?'} | {_teacher_text(m)} |")
    total = sum(meta[lv]["weights_mib"] for lv in levels)
    lines += ["", f"All weights together: {total:.2f} MiB. Training time is wall-clock time on a 2-core CPU "
              "shared with other jobs; the three students were trained together in one process.", ""]
    if "loss" in results:
        lines += ["### Held-out loss", "", "| level | nats/token | perplexity | nats/character |", "|---|---:|---:|---:|"]
        for lv in levels:
            loss = results["loss"][lv]
            lines.append(f"| {lv} | {loss:.4f} | {math.exp(loss):.2f} | {results['loss_per_char'][lv]:.4f} |")
        lines += ["", f"({results['loss_tokens']:,} tokens, {results['loss_chars']:,} characters: "
                  f"{results['loss_windows']} windows of {results['seq_len']} held-out tokens, float32. Per "
                  "character compares across tokenizers; per token does not.)", ""]
    if "decode_ms" in results:
        base = results["decode_ms"][levels[0]]
        lines += ["### Per-token decode cost (batch 1, KV cache, float32)", "",
                  f"| level | ms/token | ratio to {levels[0]} | ratio to level below |", "|---|---:|---:|---:|"]
        prev = None
        for lv in levels:
            ms = results["decode_ms"][lv]
            below = f"{ms / results['decode_ms'][prev]:.2f}x" if prev else "-"
            lines.append(f"| {lv} | {ms:.2f} | {ms / base:.2f}x | {below} |")
            prev = lv
        lines.append("")
    if "acceptance" in results:
        acc = results["acceptance"]
        for key, title in (("greedy", "greedy (argmax agreement)"),
                           ("sampled", f"at T={acc['temperature']} (expected speculative-sampling acceptance)")):
            lines += [f"### Acceptance, {title}", "",
                      "rows: drafter, columns: verifier; " f"{acc['prompts']} held-out prompts x {acc['new_tokens']} "
                      "verifier-generated tokens", "",
                      "| drafter \\ verifier | " + " | ".join(levels) + " |", "|---|" + "---:|" * len(levels)]
            for d in levels:
                lines.append(f"| {d} | " + " | ".join(f"{acc[key][d][v]:.3f}" for v in levels) + " |")
            lines.append("")
    if "text" in results:
        lines += _text_lines(levels, results["text"])
    targets = check_targets(results)
    if targets:
        lines += ["### Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {desc} | {targets[key][1]} | {'yes' if targets[key][0] else '**no**'} |"
                  for key, desc in TARGETS if key in targets]
        lines.append("")
    return "\n".join(lines)


def _text_lines(levels, text: dict) -> list[str]:
    lines = ["### Text", "", f"Greedy continuations of {text['prompts']} held-out prompts, {text['new_tokens']} "
             f"tokens each: the median share of tokens closing a 4-gram already written in that continuation, "
             f"and the share of continuations at or above {text['loop_threshold']} (loops).", "",
             "| level | median repeated-4-gram share | loops |", "|---|---:|---:|"]
    lines += [f"| {lv} | {text['greedy_repetition_median'][lv]:.3f} | {text['greedy_loop_share'][lv]:.0%} |"
              for lv in levels]
    sam = text["samples"]
    lines += ["", f"Sampled continuations of `{sam['level']}` (T = {sam['temperature']}, no top-k/top-p, seed i for "
              f"prompt i), as they are; the prompt, then the continuation after the marker line:", ""]
    for prompt, cont in zip(sam["prompts"], sam["texts"]):
        lines += ["````python", prompt.rstrip("\n"), "# ---- sampled ----", cont, "````", ""]
    return lines


def run(args) -> int:
    import torch

    from cascade.train.heldout import load_prompts

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models, tokenizer, meta = load_family(args.family, args.levels)
    results = {"family": str(args.family), "levels": list(args.levels), "meta": meta,
               "shared_tokenizer": shared_tokenizer(args.family, args.levels),
               "torch_threads": args.threads, "seq_len": args.seq_len,
               "command": "cascade model-card " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else None}
    if "loss" not in args.skip:
        windows = heldout_windows(tokenizer, args.seq_len, args.loss_windows)
        results["loss"] = heldout_losses(models, windows)
        results["loss_windows"] = windows.size(0)
        results["loss_tokens"] = windows.size(0) * args.seq_len
        results["loss_chars"] = chars = predicted_chars(tokenizer, windows)
        results["loss_per_char"] = {lv: nats_per_char(loss, tokenizer, windows, chars)
                                    for lv, loss in results["loss"].items()}
        print("held-out loss:", {k: round(v, 4) for k, v in results["loss"].items()}, flush=True)
    if "decode" not in args.skip:
        results["decode_ms"] = decode_costs(models, len(tokenizer), args.decode_rounds, args.decode_steps)
        print("decode ms/token:", {k: round(v, 3) for k, v in results["decode_ms"].items()}, flush=True)
    if "acceptance" not in args.skip:
        prompts = load_prompts(args.prompts)[: args.max_prompts]
        results["acceptance"] = acceptance_matrix(models, tokenizer, prompts, args.new_tokens, args.temperature)
    if "text" not in args.skip:
        prompts = load_prompts(args.prompts)[: args.max_prompts]
        results["text"] = text_quality(models, tokenizer, prompts, args.text_tokens, args.temperature, args.samples)
        print("greedy repetition (median):", {k: round(v, 3) for k, v in
                                              results["text"]["greedy_repetition_median"].items()}, flush=True)
    md = markdown(results)
    print(md)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cascade")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
