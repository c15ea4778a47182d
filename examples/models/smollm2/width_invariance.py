"""Does the authority's bf16 logit for a position depend on how many positions and rows a pass scores?

Loads SmolLM2-135M-Instruct as the HF worker does (``dtype`` bf16 where the CPU computes it
natively), builds the lean forward (workers/lean.py) with and without ``batch_invariant``, and after
a ~100-token chat prefix:

* scores widths 1..16 from the same cache and compares, bit for bit, the logits of the same
  positions across widths; scores 1..8 rows of the same sequence and compares row 0 with a pass of
  one row;
* per op: each product (through the lean forward's products) on 1 row vs the first row of k rows.

What it found (docs/exactness.md, "Batch invariance"): torch's CPU attention's output for a query
row moves by a rounding step with the number of key columns in the call (masked ones included), not
with the number of query rows, so a position scored in a wider pass (more columns) differs from the
same position scored alone; and oneDNN's bf16 product of a single row is another kernel than that of
two or more rows, whose sums differ from it by a rounding step on some rows (random rows rarely show
it; the prompt scored one position per pass does). The norms and the rotary embedding are
row-invariant. ``batch_invariant`` fixes the key blocks' shape (workers/lean.py
``invariant_attention``) and multiplies a single row as two.

    OMP_NUM_THREADS=1 python examples/models/smollm2/width_invariance.py
"""
from __future__ import annotations

import argparse

import torch

from cascade.pull import cache_root
from workers import lean


class Layer:
    """A cache layer as the lean forward uses one (update returns all keys/values)."""

    def __init__(self, keys=None, values=None):
        self.keys, self.values = keys, values

    def update(self, k, v):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def get_seq_length(self):
        return 0 if self.keys is None else self.keys.shape[2]

    def copy(self, rows=1):
        return Layer(self.keys.repeat(rows, 1, 1, 1), self.values.repeat(rows, 1, 1, 1))


def load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cache_root() / "models" / "smollm2-135m-instruct"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Explain, in a few short paragraphs, why the sky looks blue during the "
             "day and red or orange at sunset, and what Rayleigh scattering has to do with it. Keep it simple "
             "enough for a curious ten-year-old, and end with one fun fact about the colour of sunsets on Mars."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    return model, torch.tensor(ids)


def score(forward, layers, tokens, start, rows=1):
    width = tokens.numel()
    ids = tokens[None].repeat(rows, 1)
    pos = (start + torch.arange(width))[None].repeat(rows, 1)
    with torch.inference_mode():
        return forward(ids, pos, [layer.copy(rows) for layer in layers], None, width)


def whole_pass(forward, ids, cont):
    layers = [Layer() for _ in range(30)]
    with torch.inference_mode():
        forward(ids[None], torch.arange(ids.numel())[None], layers, None, 1)
    start = ids.numel()
    by_width = {w: score(forward, layers, cont[:w], start)[0] for w in range(1, 17)}
    worst = []
    for j in range(16):  # position start + j, scored by every width > j
        ref = by_width[j + 1][j]
        worst.append(sum(not torch.equal(by_width[w][j], ref) for w in range(j + 1, 17)))
    rows_diff = {}
    for width in (1, 4):
        ref = score(forward, layers, cont[:width], start, 1)[0]
        rows_diff[width] = [r for r in range(2, 9)
                            if not torch.equal(score(forward, layers, cont[:width], start, r)[0], ref)]
    max_abs = max(float((by_width[w][0].float() - by_width[1][0].float()).abs().max()) for w in range(2, 17))
    # the prompt's last logits with the prompt scored one position per pass (one-row products)
    single = [Layer() for _ in range(30)]
    with torch.inference_mode():
        for i in range(ids.numel()):
            last = forward(ids[None, i:i + 1], torch.tensor([[i]]), single, None, 1)
        whole = forward(ids[None], torch.arange(ids.numel())[None], [Layer() for _ in range(30)], None, 1)
    return worst, rows_diff, max_abs, torch.equal(last, whole)


def products(model):
    layer = model.model.layers[0]
    mods = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_proj, "down_proj": layer.mlp.down_proj, "lm_head": model.lm_head}
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, m in mods.items():
        op = lean.linear_product(m.weight, m.bias, True)  # the same products in either mode
        x = torch.randn(16, m.weight.shape[1], generator=g).to(torch.bfloat16)
        one = op(x[:1])
        out[name] = [k for k in range(2, 17) if not torch.equal(op(x[:k])[:1], one)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    torch.set_num_threads(1)
    model, ids = load()
    print(f"prefix {ids.numel()} tokens, dtype {model.dtype}, packable {lean._packable(model)}")
    cont = torch.randint(0, 49152, (16,), generator=torch.Generator().manual_seed(2))
    for invariant in (False, True):
        kwargs = {"batch_invariant": True} if invariant else {}
        forward = lean.lean_forward(model, **kwargs)
        worst, rows_diff, max_abs, one_by_one = whole_pass(forward, ids, cont)
        print(f"\nbatch_invariant={invariant}")
        print("  position j: how many widths > j differ from width j+1:", worst)
        print("  rows 2..8 whose row 0 differs from one row (width 1, width 4):", rows_diff)
        print(f"  largest |logit difference| at the first position, widths 2..16 vs 1: {max_abs:.4f}")
        print("  the prompt one position per pass == in one pass:", one_by_one)
    print("products (random rows), row counts k whose first row differs from 1 row:", products(model))


if __name__ == "__main__":
    main()
