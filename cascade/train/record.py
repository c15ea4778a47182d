"""``cascade record``: the authority's own conversations and its next-token distributions, for
distilling drafters on what the authority really writes (on-policy data, as DistillSpec argues).

Each sequence is a chat in the model's own template. For a *chat* sequence the authority writes
the user turn too (sampled after ``<|im_start|>user\\n``), then answers it; for a *code* sequence
the user turn asks about a snippet of Python from the training corpus (never the held-out
packages), and the authority answers. Batches cycle through sampling temperatures (1.0, 0.7 and
greedy), so the drafters see the text that sampled and greedy decoding produce.

Generation runs through cascade itself (continuous batching: every forward pass covers all of a
shard's conversations in flight, and its samples are exact), over a one-level topology of the
authority or over ``--topology`` (a hierarchy whose drafters speed it up). Then one pass over each
finished conversation records the top-k of the authority's next-token log-probabilities at
temperature 1 at every position. Shards (``shard-NNNNN.pt``, one batch each) are resumable: an
interrupted run starts again at the first missing one, and a finished one can be extended with a
larger ``--sequences``.

``--keep DIR`` also writes each shard's token ids alone, compressed (``shard-NNNNN.npz``, ~1 byte
a token): small enough to keep in a repository. A shard found there is not generated again, only
scored (one pass), so recordings accumulate across machines whose caches do not last.
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
END_OF_TURN = "<|im_end|>"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "record", help="record an authority's own conversations and next-token top-k, for distillation",
        description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("--model", required=True, help="the authority: a model folder or pulled:NAME")
    p.add_argument("--out", required=True, help="folder for the shards (resumed when it has some)")
    p.add_argument("--topology", help="generate through this topology (its authority must be --model's); "
                                      "default: a one-level topology of --model")
    p.add_argument("--keep", help="also write each shard's token ids, compressed, to this folder, and take "
                                  "the shards found there instead of generating them")
    p.add_argument("--sequences", type=int, default=4096, help="total sequences to have recorded")
    p.add_argument("--batch", type=int, default=48,
                   help="sequences per shard, all generated together (continuous batching)")
    p.add_argument("--code-share", type=float, default=0.3, help="share of sequences about corpus code")
    p.add_argument("--corpus", default="manifest:examples/models/CORPUS.tsv",
                   help="where code snippets come from (a corpus spec of cascade distill)")
    p.add_argument("--user-tokens", type=int, default=64, help="longest user turn the authority writes")
    p.add_argument("--answer-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--top-k", type=int, default=16, help="log-probabilities kept per position")
    p.add_argument("--dtype", default="fastest", choices=("fastest", "float32", "bfloat16"),
                   help="the authority's dtype (fastest: bfloat16 where the CPU computes it natively, else float32)")
    p.add_argument("--device", default="cpu", help="where the authority runs: cpu, auto or cuda[:N]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    model, tok = _load(args.model, args.dtype, _device(args.device))
    snippets = _snippets(args.corpus, args.seed) if args.code_share > 0 else []
    meta_path = out / "record.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {
        "model": args.model, "dtype": str(model.dtype).replace("torch.", ""), "top_k": args.top_k, "batch": args.batch,
        "code_share": args.code_share, "corpus": args.corpus, "seed": args.seed,
        "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens,
        "temperatures": TEMPERATURES, "torch": torch.__version__, "shards": {}}
    shards = -(-args.sequences // args.batch)
    generator = None
    try:
        for index in range(shards):
            path = out / f"shard-{index:05d}.pt"
            if path.is_file():
                continue
            kept = keep / path.with_suffix(".npz").name if keep is not None else None
            started = time.perf_counter()
            if kept is not None and kept.is_file():
                ids = load_ids(kept)
                how = "scored from " + str(kept)
            else:
                generator = generator or _generator(args, out)
                ids = generate_batch(generator, tok, index, args, snippets)
                how = "generated"
                if kept is not None:
                    save_ids(ids, kept)
            generated = time.perf_counter() - started
            shard = {**ids, **score(model, ids["tokens"], ids["lengths"], args.top_k)}
            torch.save(shard, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            took = time.perf_counter() - started
            tokens = int(shard["lengths"].sum())
            meta["shards"][path.name] = {"tokens": tokens, "seconds": round(took, 1), "how": how.split()[0],
                                         "generate_seconds": round(generated, 1),
                                         "temperature": shard["temperature"]}
            meta_path.write_text(json.dumps(meta, indent=1) + "\n")
            total = sum(s["tokens"] for s in meta["shards"].values())
            print(f"{path.name}: {len(shard['lengths'])} sequences, {tokens} tokens {how} in {took:.0f} s "
                  f"({tokens / max(took, 1e-9):.0f} tokens/s; T={shard['temperature']}); "
                  f"{len(meta['shards'])}/{shards} shards, {total:,} tokens", flush=True)
    finally:
        if generator is not None:
            generator.close()
    return 0


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if name == "cuda" else name


def _load(ref: str, dtype: str, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade.pull import PULLED, resolve_pulled

    path = str(resolve_pulled(ref)) if ref.startswith(PULLED) else ref
    from workers.devices import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, torch.device(device)))
    tok = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tok


def _generator(args, out: Path):
    """The cascade that writes the conversations: ``--topology``, or the authority alone."""
    from cascade import Cascade

    device = _device(args.device)
    if args.topology:
        return Cascade.from_topology(args.topology, device=device)
    model = args.model if args.model.startswith("pulled:") else str(Path(args.model).resolve())
    path = out / "authority.yaml"
    path.write_text(json.dumps({"name": "record", "levels": [{"name": "authority", "model": model, "dtype": args.dtype}],
                                "policy": {"name": "fixed"}}) + "\n")  # JSON is YAML
    return Cascade.from_topology(path, device=device)


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


def generate_batch(cascade, tok, index: int, args, snippets: list[str]) -> dict:
    """One shard's conversations, as token ids: a pure function of (seed, shard index, batch)
    up to the rounding of the forward pass (bf16 passes of other widths may break a near-tie)."""
    import torch

    rng = random.Random(f"{args.seed}:{index}")
    temperature = TEMPERATURES[index % len(TEMPERATURES)]
    n_code = sum(rng.random() < args.code_share for _ in range(args.batch)) if snippets else 0
    users = [rng.choice(CODE_ASKS).format(code=rng.choice(snippets)) for _ in range(n_code)]
    users += _user_turns(cascade, tok, args.batch - n_code, args.user_tokens, temperature, rng.getrandbits(31))
    prompts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
               for u in users]
    sequences = _generate(cascade, tok, prompts, args.answer_tokens, temperature, rng.getrandbits(31))
    return {"tokens": torch.cat([torch.tensor(s, dtype=torch.int32) for s in sequences]),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
            "kinds": ["code"] * n_code + ["chat"] * (args.batch - n_code), "temperature": temperature}


def _generate(cascade, tok, prompts: list[str], max_new: int, temperature: float, seed: int) -> list[list[int]]:
    """Each prompt's tokens followed by what the model wrote (cut after its end of turn), all
    prompts in flight together; prompt ``i`` draws with ``seed + i``."""
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    done = cascade.generate(ids, max_new_tokens=max_new, temperature=temperature, top_k=0, top_p=1.0,
                            seed=seed, batch_size=len(ids))
    rows = []
    for prompt, gen in zip(ids, done):
        new = list(gen.token_ids)
        if end in new:
            new = new[:new.index(end) + 1]
        rows.append(prompt + new)
    return rows


def _user_turns(cascade, tok, n: int, max_new: int, temperature: float, seed: int) -> list[str]:
    """User messages the authority writes itself, sampled after the user turn's header."""
    if n == 0:
        return []
    header = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    header = header[:header.rindex(END_OF_TURN)]
    texts = []
    for row in _generate(cascade, tok, [header] * n, max_new, max(temperature, 0.8), seed):
        text = tok.decode(row, skip_special_tokens=False)[len(header):].replace(END_OF_TURN, "").strip()
        texts.append(text or "Hello!")
    return texts


def score(model, tokens, lengths, k: int, chunk: int = 8) -> dict:
    """The model's top-k next-token log-probabilities (temperature 1) at every position but the
    last of each sequence, packed like the tokens: ``topk_ids`` / ``topk_logprobs`` of shape
    ``[sum(lengths) - len(lengths), k]``.

    Sequences go through in right-padded chunks (padding after a row changes nothing before it
    under the causal mask); only each row's real positions are kept."""
    import torch

    sequences = list(torch.split(tokens.long(), lengths.tolist()))
    ids, logp = [], []
    with torch.inference_mode():
        for start in range(0, len(sequences), chunk):
            part = [s[:-1] for s in sequences[start:start + chunk]]
            width = max(len(s) for s in part)
            batch = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width, dtype=torch.long)
            for r, s in enumerate(part):
                batch[r, :len(s)] = s
                mask[r, :len(s)] = 1
            logits = model(input_ids=batch.to(model.device), attention_mask=mask.to(model.device)).logits
            for r, s in enumerate(part):
                top = torch.log_softmax(logits[r, :len(s)].float(), -1).topk(k, dim=-1)
                ids.append(top.indices.to(torch.int32).cpu())
                logp.append(top.values.to(torch.float16).cpu())
    return {"topk_ids": torch.cat(ids), "topk_logprobs": torch.cat(logp)}


def save_ids(ids: dict, path: Path) -> None:
    """A shard's token ids alone, compressed (uint16 where the vocabulary fits)."""
    import numpy as np

    tokens = ids["tokens"].numpy()
    dtype = np.uint16 if tokens.size == 0 or tokens.max() < 2 ** 16 else np.int32
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=tokens.astype(dtype), lengths=ids["lengths"].numpy(),
                        kinds=np.array(ids["kinds"]), temperature=np.float64(ids["temperature"]))
    tmp.rename(path)


def load_ids(path: Path) -> dict:
    import numpy as np
    import torch

    with np.load(path) as z:
        return {"tokens": torch.from_numpy(z["tokens"].astype(np.int32)),
                "lengths": torch.from_numpy(z["lengths"].astype(np.int32)),
                "kinds": [str(k) for k in z["kinds"]], "temperature": float(z["temperature"])}
