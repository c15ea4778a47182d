"""Plain decoding baselines, measured with the same clock as the cascade."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from cascade.errors import RequestError


def as_loaded(model):
    """``model`` as transformers loaded it, for the baselines that run transformers' own forward
    on a level's model: the model itself, or — where the lean forward stored large weights
    column-major for its one-row passes (:func:`workers.kernels.products.column_major`, used where the
    few-row kernel is not), which would also change what transformers' kernels cost — a copy
    with every parameter row-major again, made once per model (memory: the model once more) and
    kept beside it. Values are the same."""
    if all(p.is_contiguous() for p in model.parameters()):
        return model
    copy = getattr(model, "_cascade_as_loaded", None)
    if copy is None:
        import copy as copying

        copy = copying.deepcopy(model)  # tied parameters stay tied
        for p in copy.parameters():
            p.data = p.data.contiguous()
        object.__setattr__(model, "_cascade_as_loaded", copy)  # not a submodule: not in its state
    return copy


def assisted_unfit(draft, authority) -> str | None:
    """Why transformers' assisted generation cannot take this draft level (its worker) as the
    assistant of ``authority``'s model, as a clause to follow the level's name, or None where it
    can: it needs a transformers model that
    reads and writes the authority's token ids, and transformers tells vocabularies apart by
    their size alone (a different size is refused with an error; a trimmed draft vocabulary
    would be fed ids it does not know)."""
    model = getattr(draft, "model", None)
    if model is None or not hasattr(model, "generate"):
        return "is not a transformers model (assisted generation takes one as its assistant)"
    if getattr(draft, "draft_vocab", None) is not None:
        return "has a trimmed draft vocabulary (draft_vocab.json): its ids are not the authority's"
    theirs = model.config.get_text_config().vocab_size
    ours = authority.model.config.get_text_config().vocab_size
    if theirs != ours:
        return f"has a vocabulary of {theirs} tokens, the authority {ours}"
    return None


def authority_alone(c):
    """A :class:`cascade.api.Cascade` over ``c``'s authority alone (its worker shared, not
    closed by this one): cascade's own forward with no drafting, which ``cascade bench`` calls
    ``cascade:authority``; what a configuration gains over it is what drafting bought."""
    from cascade.api import Cascade
    from cascade.topology import topology_from_dict
    from policies import from_spec

    topo = c.topology
    level = topo.spec.level(topo.authority).model_dump(exclude_unset=True)  # as written
    alone = topology_from_dict({"name": f"{topo.spec.name}-authority", "levels": [level], "edges": []}, topo.source,
                               topo.base_dir, check_models=False)
    return Cascade(alone, {topo.authority: c.workers[topo.authority]}, c.tokenizer, from_spec("fixed"))


def plain_generate(model, prompt_ids: list[int], max_new_tokens: int, sampling=None,
                   seed: int | None = None) -> tuple[list[int], float]:
    """Decoding of ``model`` alone with transformers' own ``generate``: greedy, or sampled with
    ``sampling`` (a :class:`cascade.sampling.Sampling` with temperature > 0; ``seed`` seeds
    torch's global generator first, which transformers samples from).

    Returns (new token ids, seconds). Stops at the model's EOS like the cascade does.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = generate_kwargs(sampling)
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            pad_token_id=model.generation_config.pad_token_id or model.generation_config.eos_token_id, **kwargs,
        )
    seconds = time.perf_counter() - t0
    return out[0, len(prompt_ids):].tolist(), seconds


def generate_kwargs(sampling=None) -> dict:
    """transformers ``generate`` arguments for a :class:`cascade.sampling.Sampling` (None or
    temperature 0: greedy). Every filter is passed, off ones as their off values (top-k 0, top-p
    1), so no default of transformers' or of the model's generation config applies in their
    place; transformers warps in cascade's order (temperature, top-k, top-p)."""
    if sampling is None or sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file: one object per line with a ``prompt`` field; with ``limit``
    (>= 1), the first ``limit`` of them."""
    return [prompt for _, prompt in load_prompt_lines(path, limit)]


def load_prompt_lines(path: str | Path, limit: int | None = None) -> list[tuple[int, str]]:
    """:func:`load_prompts` with each prompt's line number (1-based) in the file."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(f"limit: must be an integer >= 1 (got {limit!r})")
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"prompts: file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"prompts: {path}: not UTF-8 text: {exc}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError(f"prompts: {path}:{n}: invalid JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise RequestError(f"prompts: {path}:{n}: expected an object with a non-empty 'prompt' string")
        prompts.append((n, obj["prompt"]))
    if not prompts:
        raise RequestError(f"prompts: {path} holds no prompts")
    return prompts if limit is None else prompts[:limit]
