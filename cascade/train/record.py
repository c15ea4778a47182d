"""``cascade record``: the authority's own conversations and its next-token distributions, for
distilling drafters on what the authority really writes (on-policy data, as DistillSpec argues).

Each sequence is a chat in the model's own template. For a *chat* sequence the authority writes
the user turn too (sampled after ``<|im_start|>user\\n``), then answers it; for a *code* sequence
the user turn asks about a snippet of Python from the training corpus (never the held-out
packages), and the authority answers. Batches cycle through sampling temperatures (1.0, 0.7 and
greedy), so the drafters see the text that sampled and greedy decoding produce.

Generation runs through cascade itself (continuous batching: every forward pass covers all the
conversations in flight, and its samples are exact), over a one-level topology of the authority
or over ``--topology`` (a hierarchy whose drafters speed it up). ``--batch`` conversations stay in
flight across shards: ``--group`` shards are open at once, and a conversation that ends gives its
place to the next, so the batch does not drain at each shard's end (:func:`generate_shards`).
Then one pass over each finished conversation records the top-k of the authority's next-token
log-probabilities at temperature 1 at every position: what a drafter is distilled on (``--top-k 0``
skips the pass: a feature head computes its own targets from the authority's features).
Generation and scoring each run in the dtype whose products are faster here at that pass's width
(``--dtype measured``, timed at start). Shards (``shard-NNNNN.pt``, ``--batch`` conversations
each, a pure function of (seed, index, batch) whatever the grouping, for one dtype) are
resumable: an interrupted run generates only the missing ones, and a finished one can be
extended with a larger ``--sequences``.

``--keep DIR`` also writes each shard's token ids alone, compressed (``shard-NNNNN.npz``, ~1 byte
a token): small enough to keep in a repository. A shard found there is not generated again, only
scored (one pass), so recordings accumulate across machines whose caches do not last. ``--first N``
records shards ``N`` on only, so that two recorders (two cores, two machines) extend one ``--keep``
folder side by side: the shards are numbered, and each is a pure function of its index.
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
    p.add_argument("--first", type=int, default=0,
                   help="the first shard this run records: the ones before it are another recorder's (another "
                        "core's or machine's, writing the same --keep folder), which a later run takes from there")
    p.add_argument("--batch", type=int, default=48,
                   help="sequences per shard, all generated together (continuous batching)")
    p.add_argument("--group", type=int, default=3,
                   help="shards open at once: their conversations share the --batch places, so the batch stays "
                        "full across shards instead of draining at each one's end")
    p.add_argument("--code-share", type=float, default=0.3, help="share of sequences about corpus code")
    p.add_argument("--corpus", default="manifest:examples/models/CORPUS.tsv",
                   help="where code snippets come from (a corpus spec of cascade distill)")
    p.add_argument("--user-tokens", type=int, default=64, help="longest user turn the authority writes")
    p.add_argument("--answer-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--top-k", type=int, default=16,
                   help="log-probabilities kept per position; 0: none, the token ids alone, with no scoring pass "
                        "(what a feature head trains on: it computes its own targets; a drafter needs them)")
    p.add_argument("--dtype", default="measured", choices=("measured", "fastest", "float32", "bfloat16"),
                   help="the authority's dtype. measured (on a CPU): for generating and for scoring each, the faster "
                        "of float32 and bfloat16 for the model's products at that pass's width (--batch rows; a "
                        "conversation's length), timed at start; fastest: bfloat16 where the device computes it "
                        "natively, else float32")
    p.add_argument("--device", default="cpu", help="where the authority runs: cpu, auto or cuda[:N]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    if args.group < 1 or args.batch < 1:
        raise SystemExit(f"cascade record: --group and --batch must be at least 1 (got {args.group}, {args.batch})")
    if args.first < 0 or args.top_k < 0:
        raise SystemExit(f"cascade record: --first and --top-k must be at least 0 (got {args.first}, {args.top_k})")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    model, tok = _load(args.model, "float32" if args.dtype == "measured" else args.dtype, _device(args.device))
    generate_dtype, score_dtype = (args.dtype, args.dtype) if args.dtype != "measured" else (
        "" if args.topology else measured_dtype(model, args.batch, pack=True),
        measured_dtype(model, SCORE_ROWS, pack=False) if args.top_k else "")
    model = model.to(_resolved(score_dtype, model))
    generated_in = "the topology's dtypes" if args.topology else _name(generate_dtype, model)
    scoring = f"scoring in {_name(score_dtype, model)}" if args.top_k else "no scoring (--top-k 0)"
    print(f"cascade record: generating in {generated_in}, {scoring}"
          + (" (measured)" if args.dtype == "measured" else ""), flush=True)
    snippets = _snippets(args.corpus, args.seed) if args.code_share > 0 else []
    meta_path = out / "record.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {
        "model": args.model, "dtype": generated_in, "top_k": args.top_k,
        "score_dtype": _name(score_dtype, model) if args.top_k else None, "batch": args.batch,
        "code_share": args.code_share, "corpus": args.corpus, "seed": args.seed,
        "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens,
        "temperatures": TEMPERATURES, "torch": torch.__version__, "shards": {}}
    if meta["top_k"] != args.top_k:
        raise SystemExit(f"cascade record: {out}'s shards hold the top-{meta['top_k']}, not the top-{args.top_k}: "
                         f"give --top-k {meta['top_k']}, or another --out (with --keep, kept shards are only scored)")
    shards = -(-args.sequences // args.batch)
    missing = [i for i in range(args.first, shards) if not (out / f"shard-{i:05d}.pt").is_file()]
    kept = {i: keep / f"shard-{i:05d}.npz" for i in missing if keep is not None}
    kept = {i: path for i, path in kept.items() if path.is_file()}
    for index, path in kept.items():
        started = time.perf_counter()
        ids = load_ids(path)
        how = "scored from " if args.top_k else "loaded from "
        _write(out, meta, index, ids, model, args, how + str(path), started, started, shards)
    todo = [i for i in missing if i not in kept]
    if not todo:
        return 0
    generator = _generator(args, out, generate_dtype)
    try:
        started = time.perf_counter()
        for index, ids in generate_shards(generator, tok, todo, args, snippets, args.group):
            if keep is not None:
                save_ids(ids, keep / f"shard-{index:05d}.npz")
            generated = time.perf_counter()
            _write(out, meta, index, ids, model, args, "generated", started, generated, shards, generated_in)
            started = time.perf_counter()
    finally:
        generator.close()
    return 0


def _write(out: Path, meta: dict, index: int, ids: dict, model, args, how: str, started: float, generated: float,
           shards: int, dtype: str | None = None) -> None:
    """Score a shard's conversations, write it, and account for it in ``record.json``; its
    seconds run from ``started`` (the previous shard written) through generation (in ``dtype``)
    and scoring (in the model's)."""
    import torch

    path = out / f"shard-{index:05d}.pt"
    shard = {**ids, **(score(model, ids["tokens"], ids["lengths"], args.top_k) if args.top_k else {})}
    torch.save(shard, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    took = time.perf_counter() - started
    tokens = int(shard["lengths"].sum())
    meta["shards"][path.name] = {"tokens": tokens, "seconds": round(took, 1), "how": how.split()[0],
                                 "generate_seconds": round(generated - started, 1),
                                 "temperature": shard["temperature"],
                                 **({"score_dtype": _name("", model)} if args.top_k else {}),
                                 **({"dtype": dtype} if dtype else {})}
    (out / "record.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(s["tokens"] for s in meta["shards"].values())
    print(f"{path.name}: {len(shard['lengths'])} sequences, {tokens} tokens {how} in {took:.0f} s "
          f"({tokens / max(took, 1e-9):.0f} tokens/s; T={shard['temperature']}); "
          f"{len(meta['shards'])}/{shards} shards, {total:,} tokens", flush=True)


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


# The width of a scoring pass that the dtype is measured at: about a recorded conversation's length.
SCORE_ROWS = 256


def measured_dtype(model, rows: int, pack: bool, clock=time.perf_counter) -> str:
    """``"float32"`` or ``"bfloat16"``, whichever multiplies ``model``'s linear layers faster at
    ``rows`` rows here, best of 3 (each distinct weight shape once, counted as often as the model
    has it), from copies of the weights: through the lean forward's products where ``pack``
    (:func:`workers.kernels.products.linear_product`), else F.linear (transformers' forward).
    Native bfloat16 is not always the faster: without AMX, float32's products can be faster at wide
    passes and slower at narrow ones (docs/results-log.md), so the width is measured, not assumed.
    Off the CPU: ``"fastest"``."""
    import torch

    from workers.kernels.products import linear_product

    if model.device.type != "cpu":
        return "fastest"
    shapes: dict[tuple, list] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault(tuple(module.weight.shape), [module.weight, 0])[1] += 1
    generator = torch.Generator().manual_seed(0)
    costs = {}
    with torch.inference_mode():
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            costs[name] = 0.0
            for weight, count in shapes.values():
                product = linear_product(weight.detach().to(dtype, copy=True), None, pack)
                x = torch.randn(rows, weight.shape[1], generator=generator).to(dtype)
                product(x)  # the first call may pack or warm up
                best = float("inf")
                for _ in range(3):
                    start = clock()
                    product(x)
                    best = min(best, clock() - start)
                costs[name] += best * count
    return min(costs, key=costs.get)


def _resolved(dtype: str, model):
    from workers.devices import resolve_dtype

    return resolve_dtype(dtype, model.device) if dtype else model.dtype


def _name(dtype: str, model) -> str:
    """A dtype's name as resolved for ``model``'s device; ``""``: the model's own."""
    return str(_resolved(dtype, model)).replace("torch.", "")


def _generator(args, out: Path, dtype: str):
    """The cascade that writes the conversations: ``--topology``, or the authority alone in ``dtype``."""
    from cascade import Cascade

    device = _device(args.device)
    if args.topology:
        return Cascade.from_topology(args.topology, device=device)
    model = args.model if args.model.startswith("pulled:") else str(Path(args.model).resolve())
    path = out / "authority.yaml"
    path.write_text(json.dumps({"name": "record", "levels": [{"name": "authority", "model": model, "dtype": dtype}],
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


def plan_shard(index: int, args, snippets: list[str]) -> dict:
    """What shard ``index`` asks for, before anything is generated: its temperature, the code
    questions, how many user turns the authority writes, and the seeds of its two generations
    (prompt ``i`` of each draws with ``seed + i``). A pure function of (seed, index, batch)."""
    rng = random.Random(f"{args.seed}:{index}")
    temperature = TEMPERATURES[index % len(TEMPERATURES)]
    n_code = sum(rng.random() < args.code_share for _ in range(args.batch)) if snippets else 0
    users = [rng.choice(CODE_ASKS).format(code=rng.choice(snippets)) for _ in range(n_code)]
    user_seed = rng.getrandbits(31)
    return {"index": index, "temperature": temperature, "code": users, "chats": args.batch - n_code,
            "user_seed": user_seed, "answer_seed": rng.getrandbits(31)}


def generate_shards(cascade, tok, indices: list[int], args, snippets: list[str], group: int = 1):
    """Yield ``(index, ids)`` for each shard of ``indices`` as it is finished, ``--batch``
    conversations in flight all along (continuous batching across shards).

    Up to ``group`` shards are open at once, taken in the order of their temperature, then index
    (shards of one temperature share the authority's passes; a pass serves one sampling
    configuration). An open shard's user turns run first, then its answers; the places of those
    that end go to the next waiting ones (earliest opened shard first), so the batch no longer
    drains at each shard's end, only at the run's. Every request keeps its shard's seed
    (:func:`plan_shard`), so a shard's tokens do not depend on the grouping, up to the rounding
    of the forward pass (bf16 passes of other widths may break a near-tie)."""
    header = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    header = header[:header.rindex(END_OF_TURN)]
    waiting = sorted(indices, key=lambda i: (i % len(TEMPERATURES), i))
    shards: list[_Shard] = []
    batch = cascade.batch()
    flight: dict[int, tuple[_Shard, int]] = {}
    try:
        while waiting or shards:
            while waiting and len(shards) < group:
                shards.append(_Shard(plan_shard(waiting.pop(0), args, snippets), tok, header, args))
            _admit(cascade, batch, shards, flight, args.batch)
            before = list(batch.active)
            batch.step()
            for state in before:
                if state.finish_reason is not None:
                    shard, i = flight.pop(id(state))
                    shard.finished(i, list(cascade.result(state).token_ids))
            for shard in [s for s in shards if s.done]:
                shards.remove(shard)
                yield shard.plan["index"], shard.ids()
    finally:
        batch.close()


def _admit(cascade, batch, shards: list, flight: dict, places: int) -> None:
    """Fill the batch's free places from the open shards' waiting requests, earliest shard first.
    A pass serves one sampling configuration, so each configuration in flight costs a pass a
    step: a request of a configuration not in flight waits while the batch is at least half
    full (it joins as the others drain, when their passes are mostly overhead)."""
    for shard in shards:
        while shard.queue and len(batch.active) < places:
            flying = {state.request.sampling.temperature for state in batch.active}
            if shard.config() not in flying and 2 * len(batch.active) >= places:
                break
            i, state = shard.request(cascade)
            flight[id(batch.add(state))] = (shard, i)


class _Shard:
    """One shard's requests: its user turns (sampled after the user turn's header, at a
    temperature of 0.8 at least), then its answers; each row cut after its end of turn."""

    def __init__(self, plan: dict, tok, header: str, args):
        self.plan, self.tok, self.header, self.args = plan, tok, header, args
        self.end = tok.convert_tokens_to_ids(END_OF_TURN)
        self.users = list(plan["code"])
        self.rows: list[list[int] | None] = []
        self.answering = False
        self.done = False
        self._jobs([header] * plan["chats"], args.user_tokens)
        if not plan["chats"]:
            self._answer()

    def _jobs(self, prompts: list[str], max_new: int) -> None:
        self.prompts = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        self.rows = [None] * len(prompts)
        self.queue = list(range(len(prompts)))
        self.max_new = max_new

    def config(self) -> float:
        """The temperature of the requests it has waiting (they share the rest)."""
        return self.plan["temperature"] if self.answering else max(self.plan["temperature"], 0.8)

    def request(self, cascade):
        i = self.queue.pop(0)
        seed = self.plan["answer_seed"] if self.answering else self.plan["user_seed"]
        # The authority alone draws one uniform a token from the request's own generator (the
        # residual coupling): a pure function of the seed whatever the batch, without the keyed
        # coupling's noise over the whole vocabulary, which a hierarchy needs to keep a seed's
        # tokens whatever its blocks.
        coupling = "gumbel" if self.args.topology else "residual"
        return i, cascade.request(self.prompts[i], max_new_tokens=self.max_new, temperature=self.config(),
                                  top_k=0, top_p=1.0, seed=seed + i, coupling=coupling)

    def finished(self, i: int, new: list[int]) -> None:
        if self.end in new:
            new = new[:new.index(self.end) + 1]
        self.rows[i] = self.prompts[i] + new
        if any(row is None for row in self.rows):
            return
        if self.answering:
            self.done = True
            return
        for row in self.rows:
            text = self.tok.decode(row, skip_special_tokens=False)[len(self.header):]
            self.users.append(text.replace(END_OF_TURN, "").strip() or "Hello!")
        self._answer()

    def _answer(self) -> None:
        self.answering = True
        self._jobs([self.tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                                 add_generation_prompt=True) for u in self.users],
                   self.args.answer_tokens)

    def ids(self) -> dict:
        import torch

        n_code = len(self.plan["code"])
        return {"tokens": torch.cat([torch.tensor(s, dtype=torch.int32) for s in self.rows]),
                "lengths": torch.tensor([len(s) for s in self.rows], dtype=torch.int32),
                "kinds": ["code"] * n_code + ["chat"] * self.plan["chats"], "temperature": self.plan["temperature"]}


def score(model, tokens, lengths, k: int, chunk: int | None = None) -> dict:
    """The model's top-k next-token log-probabilities (temperature 1) at every position but the
    last of each sequence, packed like the tokens: ``topk_ids`` / ``topk_logprobs`` of shape
    ``[sum(lengths) - len(lengths), k]``.

    Sequences go through ``chunk`` at a time, right-padded (padding after a row changes nothing
    before it under the causal mask); only each row's real positions are kept. Default: one a
    pass on a CPU, where chunks of 8 measured slower (the pads' work and the masked attention:
    the results log has the figures) and their top-k no closer to float32's;
    8 elsewhere (an accelerator wants wide passes)."""
    import torch

    chunk = chunk or (1 if model.device.type == "cpu" else 8)
    sequences = [s for s in torch.split(tokens.long(), lengths.tolist()) if len(s) > 1]
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
            masked = {"attention_mask": mask.to(model.device)} if len(part) > 1 else {}
            logits = model(input_ids=batch.to(model.device), **masked).logits
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
