"""``cascade record``: the authority's own conversations and its next-token distributions, for
distilling drafters on what the authority really writes (on-policy data, as DistillSpec argues).

Each sequence is a chat in the model's own template. For a *chat* sequence the authority writes
the user turn too (sampled after ``<|im_start|>user\\n``), then answers it; for a *code* sequence
the user turn asks about a snippet of Python from the training corpus (never the held-out
packages), and the authority answers. Batches cycle through sampling temperatures (1.0, 0.7 and
greedy), so the drafters see the text that sampled and greedy decoding produce.

At every position the top-k of the authority's next-token log-probabilities at temperature 1 is
recorded: for the answers from the very passes that wrote them, for the prompts from one pass
over them — the distillation needs no teacher pass of its own. Shards (``shard-NNNNN.pt``, one batch each) are a
pure function of ``--seed`` and the shard index, so an interrupted run resumes where it stopped
and a finished one can be extended with a larger ``--sequences``.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

CODE_ASKS = (
    "Complete this Python code:\n```python\n{code}\n```",
    "What does this Python code do?\n```python\n{code}\n```",
    "Write a docstring for this code:\n```python\n{code}\n```",
    "Can you find a bug in this code?\n```python\n{code}\n```",
    "Rewrite this code to be more readable:\n```python\n{code}\n```",
    "Write unit tests for this code:\n```python\n{code}\n```",
)
TEMPERATURES = (1.0, 0.7, 0.0)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "record", help="record an authority's own conversations and next-token top-k, for distillation",
        description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("--model", required=True, help="the authority: a model folder or pulled:NAME")
    p.add_argument("--out", required=True, help="folder for the shards (resumed when it has some)")
    p.add_argument("--sequences", type=int, default=4096, help="total sequences to have recorded")
    p.add_argument("--batch", type=int, default=48, help="sequences generated together (one shard)")
    p.add_argument("--code-share", type=float, default=0.3, help="share of sequences about corpus code")
    p.add_argument("--corpus", default="manifest:examples/models/CORPUS.tsv",
                   help="where code snippets come from (a corpus spec of cascade distill)")
    p.add_argument("--user-tokens", type=int, default=64, help="longest user turn the authority writes")
    p.add_argument("--answer-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--top-k", type=int, default=16, help="log-probabilities kept per position")
    p.add_argument("--dtype", default="fastest", choices=("fastest", "float32", "bfloat16"),
                   help="the authority's dtype (fastest: bfloat16 where the CPU computes it natively, else float32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = _load(args.model, args.dtype)
    snippets = _snippets(args.corpus, args.seed) if args.code_share > 0 else []
    meta_path = out / "record.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {
        "model": args.model, "dtype": str(model.dtype).replace("torch.", ""), "top_k": args.top_k, "batch": args.batch,
        "code_share": args.code_share, "corpus": args.corpus, "seed": args.seed,
        "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens,
        "temperatures": TEMPERATURES, "torch": torch.__version__, "shards": {}}
    shards = -(-args.sequences // args.batch)
    for index in range(shards):
        path = out / f"shard-{index:05d}.pt"
        if path.is_file():
            continue
        started = time.perf_counter()
        shard = record_batch(model, tok, index, args, snippets)
        torch.save(shard, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        took = time.perf_counter() - started
        tokens = int(shard["lengths"].sum())
        meta["shards"][path.name] = {"tokens": tokens, "seconds": round(took, 1),
                                     "temperature": shard["temperature"]}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        total = sum(s["tokens"] for s in meta["shards"].values())
        print(f"{path.name}: {len(shard['lengths'])} sequences, {tokens} tokens in {took:.0f} s "
              f"(T={shard['temperature']}); {len(meta['shards'])}/{shards} shards, {total:,} tokens",
              flush=True)
    return 0


def _load(ref: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade.pull import PULLED, resolve_pulled

    path = str(resolve_pulled(ref)) if ref.startswith(PULLED) else ref
    from workers.devices import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, torch.device("cpu"))).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def _snippets(corpus: str, seed: int) -> list[str]:
    """Function- or class-sized pieces of the corpus's Python files."""
    from cascade.train.corpus import collect_files, read_text

    files = [f for f in collect_files([corpus]) if f.suffix == ".py"]
    random.Random(seed).shuffle(files)
    out: list[str] = []
    for f in files[:2000]:
        lines = (read_text(f) or "").splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        for i in starts[:4]:
            piece = "\n".join(lines[i:i + 16]).strip()
            if 40 <= len(piece) <= 1200:
                out.append(piece)
    return out


def record_batch(model, tok, index: int, args, snippets: list[str]) -> dict:
    """One shard: ``args.batch`` conversations and the authority's top-k at every position."""
    import torch

    rng = random.Random(f"{args.seed}:{index}")
    torch.manual_seed(rng.getrandbits(63))
    temperature = TEMPERATURES[index % len(TEMPERATURES)]
    n_code = sum(rng.random() < args.code_share for _ in range(args.batch)) if snippets else 0
    users = [rng.choice(CODE_ASKS).format(code=rng.choice(snippets)) for _ in range(n_code)]
    users += _user_turns(model, tok, args.batch - n_code, args.user_tokens, temperature)
    prompts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                       add_generation_prompt=True) for u in users]
    sequences, answers = _generate(model, tok, prompts, args.answer_tokens, temperature, args.top_k)
    # the prompts' rows from one pass over them; the answers' from the generation's own passes
    heads = _top_k(model, [s[:len(s) - len(a[0])] for s, a in zip(sequences, answers)], args.top_k)
    ids = torch.cat([x for (h, _), (a, _) in zip(heads, answers) for x in (h, a)])
    logprobs = torch.cat([x for (_, h), (_, a) in zip(heads, answers) for x in (h, a)])
    return {"tokens": torch.cat([torch.tensor(s, dtype=torch.int32) for s in sequences]),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
            "kinds": ["code"] * n_code + ["chat"] * (args.batch - n_code),
            "topk_ids": ids, "topk_logprobs": logprobs, "temperature": temperature}


def _sample_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _generate(model, tok, prompts: list[str], max_new: int, temperature: float, top_k: int = 0):
    """Each prompt's tokens followed by what the model wrote (cut after its end of turn), and,
    with ``top_k``, the top-k log-probabilities (temperature 1) each written token was drawn
    under: ``(ids [new, k], logprobs [new, k])`` per prompt, taken from the generation's own
    passes (a hook on the output head, which ``generate`` runs on the last position only), so the
    answers need no second pass."""
    import torch

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, inputs, output):
        top = torch.log_softmax(output[:, -1].float(), -1).topk(top_k, dim=-1)
        steps.append((top.indices.to(torch.int32), top.values.to(torch.float16)))

    hook = model.get_output_embeddings().register_forward_hook(keep) if top_k else None
    try:
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new, eos_token_id=end, pad_token_id=end,
                                 **_sample_kwargs(temperature))
    finally:
        if hook is not None:
            hook.remove()
    width = enc["input_ids"].shape[1]
    rows, tops = [], []
    for r in range(len(prompts)):
        prompt = enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist()
        new = out[r, width:].tolist()
        if end in new:
            new = new[:new.index(end) + 1]
        rows.append(prompt + new)
        if top_k:
            tops.append((torch.stack([steps[t][0][r] for t in range(len(new))]),
                         torch.stack([steps[t][1][r] for t in range(len(new))])))
    return (rows, tops) if top_k else rows


def _user_turns(model, tok, n: int, max_new: int, temperature: float) -> list[str]:
    """User messages the authority writes itself, sampled after the user turn's header."""
    if n == 0:
        return []
    header = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    header = header[:header.rindex("<|im_end|>")]
    texts = []
    for row in _generate(model, tok, [header] * n, max_new, max(temperature, 0.8)):
        text = tok.decode(row, skip_special_tokens=False)[len(header):].replace("<|im_end|>", "").strip()
        texts.append(text or "Hello!")
    return texts


def _top_k(model, sequences: list[list[int]], k: int, chunk: int = 8):
    """The model's top-k next-token log-probabilities (temperature 1) at every position but the
    last of each sequence: per sequence, ``[len - 1, k]`` ids and log-probabilities.

    Sequences go through in right-padded chunks (padding after a row changes nothing before it
    under the causal mask); only each row's real positions are kept."""
    import torch

    out = []
    with torch.inference_mode():
        for start in range(0, len(sequences), chunk):
            part = [s[:-1] for s in sequences[start:start + chunk]]
            width = max(len(s) for s in part)
            batch = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width, dtype=torch.long)
            for r, s in enumerate(part):
                batch[r, :len(s)] = torch.tensor(s)
                mask[r, :len(s)] = 1
            logits = model(input_ids=batch, attention_mask=mask).logits
            for r, s in enumerate(part):
                top = torch.log_softmax(logits[r, :len(s)].float(), -1).topk(k, dim=-1)
                out.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
    return out
