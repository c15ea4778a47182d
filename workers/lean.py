"""A lean forward pass for transformers' Llama-shaped models (Llama, Mistral, Qwen2, Qwen3), over the
caches the HF worker keeps.

:func:`lean_forward` computes what transformers' forward does, from the loaded model's own parts
(its embedding, rotary embedding and LM head modules, its weights applied with its modules' own
ops in their order, the same SDPA kernel), without the per-call plumbing (4D mask building,
output records, keyword plumbing, attention dispatch) that costs a small drafter more than its
arithmetic. Its logits equal transformers' (``tests/test_lean.py``). Large weights may be
multiplied from copies laid out for the kernel when the forward is built (:func:`_linear_op`),
which do not follow later changes to the model's weights. A model it does not recognise exactly
(:func:`_supported`) gets ``None`` and keeps transformers' own forward. What each part saves,
and how products are laid out on a CPU: docs/engine.md, "Batches underneath".
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from workers.kernels.products import linear_product, packable, side_by_side

Forward = Callable[..., torch.Tensor]

# model_type -> (transformers module, class-name prefix). These architectures share Llama's
# decoder exactly (pre-norm RMSNorm residual blocks, rotary attention over q/k/v/o projections
# with optional biases, a gated MLP); Qwen3 adds an RMSNorm over each query and key head.
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
}


# The widest pass whose grouped-query attention is folded into the query length (lean_forward).
FOLD_MOST_POSITIONS = 16


def lean_forward(model, capture: Callable[[torch.Tensor], None] | None = None, pack: bool | None = None,
                 capture_layers: Sequence[int] | None = None, batch_invariant: bool = False,
                 quantized: Callable | None = None) -> Forward | None:
    """``forward(input_ids, position_ids, layers, valid, keep) -> logits`` for ``model``, or None.

    * ``input_ids``, ``position_ids``: ``[rows, width]`` — the pass's new tokens and their positions;
    * ``layers``: one cache layer per decoder layer; ``layer.update(keys, values)`` stores the new
      columns and returns all of the layer's keys/values ``[rows, kv_heads, columns, head_dim]``,
      the new ones last;
    * ``valid``: ``[rows, columns]`` bool, which cached columns (the new ones included) a row may
      attend to, or None for all of them; causality among the new columns is added here;
    * ``keep``: logits are returned for the last ``keep`` positions only: ``[rows, keep, vocab]``;
    * ``among`` (optional): ``[rows, width, width]`` bool, which new positions each new position
      attends to, in place of causality among them (a tree of candidates, :mod:`workers.trees`).

    The builder's options:

    * ``capture``: called on each pass with the final hidden states of every position ``[rows,
      width, hidden]`` (the LM head's inputs), for a feature head (:mod:`workers.features`); with
      ``capture_layers``, the inputs of those decoder layers side by side instead (EAGLE-3):
      ``[rows, width, len(capture_layers) * hidden]``;
    * ``pack``: score passes of several rows with oneDNN over prepacked copies of the large
      weights (:func:`_linear_op`); None: where that is float32 on a CPU with oneDNN;
    * ``quantized``: a quantized level's products (:class:`workers.quant.Quantizer`), called with
      each module and its float product;
    * ``batch_invariant``: a position's logits do not depend on the pass's width or rows, bit for
      bit (:func:`invariant_attention`; docs/exactness.md, "Batch invariance").
    """
    if batch_invariant and (why := batch_invariance_unsupported(model)):
        raise ValueError(f"batch_invariant: {why}")
    arch = _supported(model)
    if arch is None:
        return None
    repeat_kv = arch.repeat_kv
    if pack is None:
        pack = _packable(model)
    # Products that read the same input (a layer's query, key and value projections; its gate
    # and up projections) run as one over their weights side by side, where the weights are
    # copied for the kernel anyway (prepacked bfloat16, quantized groups): each output column is
    # the same sum as alone, and one call costs less than three (docs/engine.md, "Batches underneath").
    joined = quantized is not None or (pack and model.dtype == torch.bfloat16)
    linear = lambda *modules: _linear_op(modules, pack)  # noqa: E731
    if quantized is not None:
        if batch_invariant:
            raise ValueError("batch_invariant: not with quantized products (workers/quant.py)")
        linear = lambda *modules, plain=linear: quantized(modules, plain(*modules))  # noqa: E731
    if batch_invariant:
        linear = lambda *modules, plain=linear: _two_rows_at_least(plain(*modules))  # noqa: E731

    def outputs(*parts) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        """``x -> [each part's modules' outputs side by side]``: one product of them all, split back
        by part, where ``joined``; else one product each (SiLU then reads a contiguous tensor, as
        in transformers: it rounds a strided one differently in float32)."""
        if not joined:
            products = [[linear(m) for m in part] for part in parts]
            return lambda x: [ps[0](x) if len(ps) == 1 else torch.cat([p(x) for p in ps], -1) for ps in products]
        sizes = [sum(m.weight.shape[0] for m in part) for part in parts]
        product = linear(*(m for part in parts for m in part))
        return lambda x: product(x).split_with_sizes(sizes, -1)
    inner = model.model
    decoder = list(inner.layers[: model.config.num_hidden_layers])
    attn = decoder[0].self_attn
    head_dim, scaling, groups = attn.head_dim, attn.scaling, attn.num_key_value_groups
    heads, kv_heads, half = model.config.num_attention_heads, attn.k_proj.weight.shape[0] // head_dim, head_dim // 2
    # Grouped-query attention: the kernel reads each key/value head for its group of query heads
    # (the same products as over repeated keys, without materialising the repeated copies).
    gqa = {"enable_gqa": True} if groups > 1 and _sdpa_gqa() else {}
    # A pass over a few positions (up to FOLD_MOST_POSITIONS; one too where fold_one_position says)
    # folds each key/value head's group of query heads into the query length ([rows, kv_heads,
    # groups x width, head_dim] against the unrepeated keys, the mask repeated per group): the same
    # products, which torch's CPU kernel runs faster than its grouped-query path (docs/engine.md,
    # "Batches underneath": what each costs, and how in bfloat16 it may round one step apart).
    fold_one = fold_one_position(model.dtype, model.device)
    # Each layer's tensors, fetched once (a module call and its attribute lookups cost more than
    # a small model's matrix product); the ops below are the modules' own, in their order.
    weights = [(
        _norm(layer.input_layernorm),
        outputs((layer.self_attn.q_proj, layer.self_attn.k_proj), (layer.self_attn.v_proj,)),
        linear(layer.self_attn.o_proj), _norm(layer.post_attention_layernorm),
        outputs((layer.mlp.gate_proj,), (layer.mlp.up_proj,)),
        linear(layer.mlp.down_proj), layer.mlp.act_fn,
        tuple(_norm(m) for m in _head_norms(layer.self_attn)) or None,
    ) for layer in decoder]
    final_norm = _norm(inner.norm)
    head_module, head_product = model.lm_head, linear(model.lm_head)

    def lm_head(hidden: torch.Tensor) -> torch.Tensor:
        # A hook put on the LM head after this forward was built (a pass counter) still sees
        # every pass: the module is called then, as transformers' forward would.
        if head_module._forward_hooks or head_module._forward_pre_hooks:
            return head_module(hidden)
        return head_product(hidden)

    def forward(input_ids, position_ids, layers: Sequence, valid, keep: int, among=None) -> torch.Tensor:
        rows, width = input_ids.shape
        hidden = inner.embed_tokens(input_ids)
        # x * cos + rotate_half(x) * sin with rotate_half's negation moved into sin (the same products:
        # rounding is symmetric), a roll by half a head; [rows, width, 1, head_dim], for queries and keys at once
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None]
        # The products run over the real positions only where pads are many (packed_positions): a
        # pass then costs what its real positions cost, as the policies price it.
        real = packed_positions(valid, rows, width)
        # one row per position computed through the pass ([positions, hidden]), as the products take them
        hidden = hidden.view(rows * width, -1)
        if real is None:
            spread = lambda t, *shape: t.view(rows, width, *shape)  # noqa: E731
        else:
            spread, hidden = (lambda t, *shape: _spread(t, real, rows, width, *shape)), hidden.index_select(0, real)
        mask = attention_mask(valid, width, layers[0].get_seq_length() + width, hidden.device, among)
        fold = groups > 1 and (1 < width <= FOLD_MOST_POSITIONS or (width == 1 and fold_one) or batch_invariant)
        if batch_invariant:  # each row's columns in its own order from column 0 (invariant_columns)
            if mask is None:
                mask = torch.ones(rows, 1, width, layers[0].get_seq_length() + width, dtype=torch.bool,
                                  device=hidden.device)
            gather, mask = invariant_columns(mask, per_position=among is not None)
        if fold and mask is not None:  # (never None over several positions)
            mask = mask.repeat(1, 1, groups, 1)
        if mask is not None and not batch_invariant:  # SDPA's conversion of a boolean mask, once a pass
            mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(~mask, float("-inf"))
        taken = {}  # the inputs of the layers a fused feature reads
        for index, ((norm1, qkv, wo, norm2, gate_up, down, act, head_norms), cache) in enumerate(
                zip(weights, layers)):
            if capture_layers and index in capture_layers:
                taken[index] = spread(hidden, -1)
            qk, v = (spread(y, -1, head_dim) for y in qkv(_rms(hidden, *norm1)))
            if head_norms is not None:  # Qwen3: each head's query and key normalised
                qk = torch.cat([_rms(qk[:, :, :heads], *head_norms[0]), _rms(qk[:, :, heads:], *head_norms[1])], 2)
            q, k = (qk * cos + qk.roll(half, -1) * sin).split_with_sizes([heads, kv_heads], 2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            keys, values = cache.update(k, v)
            if batch_invariant:
                if gather is not None:
                    picked = gather.expand(-1, keys.shape[1], -1, head_dim)
                    keys, values = keys.gather(2, picked), values.gather(2, picked)
                if among is not None:  # a tree: each position over its own keys (invariant_columns)
                    out = _per_position_attention(q, keys, values, mask, scaling, groups)
                else:
                    folded = q.reshape(rows, -1, groups * width, head_dim)
                    out = invariant_attention(folded, keys, values, mask, scaling).reshape(rows, -1, width, head_dim)
            elif fold:
                out = F.scaled_dot_product_attention(q.reshape(rows, -1, groups * width, head_dim), keys, values,
                                                     attn_mask=mask, scale=scaling).reshape(rows, -1, width, head_dim)
            else:
                if groups > 1 and not gqa:
                    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling, **gqa)
            out = out.transpose(1, 2).reshape(rows * width, -1)
            hidden = hidden + wo(out if real is None else out.index_select(0, real))
            gate, up = gate_up(_rms(hidden, *norm2))
            hidden = hidden + down(act(gate) * up)
        hidden = spread(hidden, -1)
        if capture is not None and capture_layers:
            capture(torch.cat([taken[k] for k in capture_layers], dim=-1))
        elif capture is not None:  # every position's features, for a feature head
            hidden = _rms(hidden, *final_norm)
            capture(hidden)
            return _logits(lm_head, hidden[:, width - keep:], valid, real)
        return _logits(lm_head, _rms(hidden[:, width - keep:], *final_norm), valid, real)

    return forward


# A pass whose real positions are fewer than this share of rows x width runs its products over
# the real ones only (packed_positions).
PACK_BELOW = 0.75


def packed_positions(valid, rows: int, width: int) -> torch.Tensor | None:
    """The flat indices (into ``rows x width``) of a pass's real new positions — those ``valid``
    marks in its last ``width`` columns — where they are fewer than ``PACK_BELOW`` of them;
    else None (every position computed, pads included)."""
    if valid is None or rows * width < 2:
        return None
    real = valid[:, -width:].reshape(-1)
    count = int(real.sum())
    if count >= PACK_BELOW * rows * width or count == 0:
        return None
    return real.nonzero().squeeze(1)


def _spread(packed: torch.Tensor, real: torch.Tensor, rows: int, width: int, *shape: int) -> torch.Tensor:
    """``[n, features]`` over the real positions -> ``[rows, width, *shape]`` (the features), zeros at pads."""
    full = packed.new_zeros(rows * width, packed.shape[-1])
    full.index_copy_(0, real, packed)
    return full.view(rows, width, *shape)


def _logits(lm_head, hidden: torch.Tensor, valid, real) -> torch.Tensor:
    """The logits ``[rows, keep, vocab]`` of the final hidden states ``[rows, keep, hidden]``; in
    a packed pass (``real``) computed for its real positions only, zeros at pads (nothing reads
    a pad's logits)."""
    if real is None:
        return lm_head(hidden.contiguous())
    rows, keep = hidden.shape[:2]
    tail = valid[:, -keep:].reshape(-1).nonzero().squeeze(1)
    picked = lm_head(hidden.reshape(rows * keep, -1).index_select(0, tail))
    out = picked.new_zeros(rows * keep, picked.shape[-1])
    out.index_copy_(0, tail, picked)
    return out.view(rows, keep, -1)


# Batch-invariant attention scores keys in blocks of this many columns, counted from column 0.
INVARIANT_BLOCK = 256


def invariant_attention(q, keys, values, mask, scale: float) -> torch.Tensor:
    """Attention whose output for a query row does not depend on the pass's other rows or on how
    many columns it has past those the row sees (torch's CPU kernel's does, in bfloat16:
    docs/exactness.md, "Batch invariance"): the columns go in fixed blocks of
    :data:`INVARIANT_BLOCK` from column 0 (the last padded and masked), each through the kernel at
    one shape, merged in float32 in column order by their log-sum-exp; a block a row sees nothing
    of weighs exactly zero. ``q`` ``[rows, heads, n, d]``; ``keys``/``values`` ``[rows, heads,
    columns, d]``; ``mask`` ``[rows, 1, n, columns]`` bool (True = attend)."""
    columns = keys.shape[2]
    blocks = -(-columns // INVARIANT_BLOCK)
    pad = blocks * INVARIANT_BLOCK - columns
    if pad:
        keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    outs, sums, seen = [], [], []
    for b in range(blocks):
        cut = slice(b * INVARIANT_BLOCK, (b + 1) * INVARIANT_BLOCK)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys[:, :, cut], values[:, :, cut], 0.0, False, attn_mask=bias[..., cut], scale=scale)
        if blocks == 1:
            return out
        outs.append(out)
        sums.append(lse)
        seen.append(mask[..., cut].any(-1))  # (the kernel's log-sum-exp of an empty row is not -inf)
    top = torch.stack([torch.where(s, lse, float("-inf")) for s, lse in zip(seen, sums)]).amax(0)
    total = torch.zeros_like(top)
    merged = torch.zeros(outs[0].shape, dtype=torch.float32, device=q.device)
    for out, lse, s in zip(outs, sums, seen):
        weight = torch.where(s, torch.exp(lse - top), 0.0)
        total = total + weight
        merged = merged + weight.unsqueeze(-1) * out.float()
    return (merged / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).to(q.dtype)


def invariant_columns(mask: torch.Tensor, per_position: bool = False):
    """``(gather, mask)`` for :func:`invariant_attention`: where a row's columns (those any of its
    positions sees) are not the first ones in the cache — a pool's left padding and holes, which
    other rows' lengths decide — an index that gathers each row's keys/values to columns
    ``0..n-1`` in their order (``[rows, 1, n, 1]``), and the mask over them; else ``(None, mask)``:
    a position reads its keys in the same blocks however its row sits among others.
    ``per_position`` (a tree, whose nodes skip their siblings' columns): each position's own
    columns, ``[rows, 1, width * n, 1]`` and a mask ``[rows * width, 1, 1, n]``, so that a node
    reads its keys as its path would as a chain."""
    if per_position:
        seen = mask[:, 0]  # [rows, width, columns]
        most = int(seen.sum(-1).max())
        order = torch.argsort((~seen).to(torch.uint8), dim=-1, stable=True)[..., :most]
        rows, width = seen.shape[:2]
        return order.reshape(rows, 1, width * most, 1), seen.gather(2, order).reshape(rows * width, 1, 1, most)
    row_seen = mask[:, 0].any(1)  # [rows, columns]
    most = int(row_seen.sum(-1).max())
    if bool(row_seen[:, :most].all()):
        return None, mask
    order = torch.argsort((~row_seen).to(torch.uint8), dim=-1, stable=True)[:, :most]  # seen first, in order
    mask = mask.gather(3, order[:, None, None, :].expand(-1, 1, mask.shape[2], -1))
    return order[:, None, :, None], mask


def _per_position_attention(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
    """:func:`invariant_attention` with each position of ``q`` ``[rows, heads, width, d]`` over
    its own gathered keys ``[rows, kv_heads, width * n, d]`` (:func:`invariant_columns`)."""
    rows, heads, width, d = q.shape
    kv = heads // groups
    q = q.reshape(rows, kv, groups, width, d).permute(0, 3, 1, 2, 4).reshape(rows * width, kv, groups, d)
    keys, values = (t.reshape(rows, kv, width, -1, d).transpose(1, 2).reshape(rows * width, kv, -1, d)
                    for t in (keys, values))
    out = invariant_attention(q, keys, values, mask.expand(-1, -1, groups, -1), scale)
    return out.reshape(rows, width, kv, groups, d).permute(0, 2, 3, 1, 4).reshape(rows, heads, width, d)


def _two_rows_at_least(product: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``product`` with a one-row input multiplied as two rows (the row twice): oneDNN multiplies a
    single bfloat16 row by another kernel, whose sums come out a rounding step apart from the same
    row's among several, while every count of two or more rows gives a row the same result."""
    def multiply(x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return product(x)
        return product(x.reshape(1, -1).repeat(2, 1))[:1].view(*x.shape[:-1], -1)

    return multiply


def batch_invariant_setting(setting: bool | str, model) -> bool:
    """A level's ``batch_invariant`` (true, false or auto) for ``model``: auto is on where the lean
    forward can be batch-invariant (:func:`batch_invariance_unsupported`); true is checked there."""
    if setting == "auto":
        return batch_invariance_unsupported(model) is None
    return bool(setting)


def batch_invariance_unsupported(model) -> str | None:
    """Why the lean forward cannot be batch-invariant for ``model`` here, or None: it needs
    bfloat16 on a CPU where oneDNN computes it natively (products from prepacked copies, each row
    the same kernel whatever the row count) and torch's CPU flash-attention kernel."""
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return f"needs a bfloat16 model on a CPU (this one is {model.dtype} on {model.device.type})"
    if not packable(model.lm_head.weight):
        return "needs a CPU where oneDNN computes bfloat16 natively (AVX-512 BF16 or AMX)"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "needs torch's CPU flash-attention kernel (torch >= 2.3)"
    return None


def _sdpa_gqa() -> bool:
    """Whether this torch's SDPA takes grouped keys and values (``enable_gqa``, torch >= 2.5)."""
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def fold_one_position(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the lean forward folds a grouped-query pass over one position (see lean_forward):
    in bfloat16 on a CPU, where torch's grouped-query kernel over one position is slow on some
    processors. In float32 both cost the same, and float32's greedy record stays on the same arithmetic."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def attention_mask(valid, width: int, columns: int, device, among=None):
    """The pass's boolean attention mask ``[rows, 1, width, columns]`` (True = attend), or None
    when a single new token may see every column. ``among`` ``[rows, width, width]``: which new
    positions each new one sees (default: causal). With ``among``, every new position sees at
    least itself, pads included (which no real position sees): no row of the mask is empty, so
    no attention kernel makes a NaN of one (an eager float32 softmax over a float64 mask would)."""
    if among is not None:
        seen = torch.ones(among.shape[0], width, columns, dtype=torch.bool, device=device)
        seen[:, :, columns - width:] = among
        if valid is not None:
            seen &= valid[:, None, :columns]
        seen[:, :, columns - width:] |= torch.eye(width, dtype=torch.bool, device=device)
        return seen[:, None]
    if valid is None and width == 1:
        return None
    causal = torch.ones(width, columns, dtype=torch.bool, device=device).tril(columns - width)
    if valid is None:
        return causal[None, None]
    return (valid[:, None, :columns] & causal[None])[:, None]


def _linear_op(modules: Sequence, pack: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product of ``modules`` (linear layers reading the same input) as one function, their
    outputs side by side (:func:`workers.kernels.products.linear_product`)."""
    return linear_product(*side_by_side(modules), pack)


def _packable(model) -> bool:
    """Whether oneDNN can score ``model``'s several-row passes from prepacked float32 weights
    here, as checked on one of its own matrices against F.linear."""
    return packable(model.lm_head.weight)


def _norm(module) -> tuple:
    return module.weight, module.variance_epsilon


def _head_norms(attn) -> tuple:
    """The attention's per-head query and key norms (Qwen3); () when it has none."""
    return tuple(getattr(attn, name) for name in ("q_norm", "k_norm") if hasattr(attn, name))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: normalised in float32, rounded to the input dtype, times the weight. On a
    CPU ``F.rms_norm`` (torch >= 2.4) runs those very ops (upcast, pow, mean, add, rsqrt, mul, cast
    back) in one call, bit for bit (tests/test_lean.py), for less than issuing them one by one."""
    if x.is_cpu and x.dtype in _RMS_NORM_DTYPES:
        return weight * F.rms_norm(x, x.shape[-1:], eps=eps)
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# the dtypes whose statistics F.rms_norm computes in float32, as LlamaRMSNorm does (float64's in float64)
_RMS_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16) if hasattr(F, "rms_norm") else ()


def _supported(model):
    """The model's transformers module if the model is exactly one of :data:`ARCHITECTURES`, in
    inference, with SDPA attention over the full context (no sliding window) and no hooks on its
    modules; else None."""
    import importlib

    spec = ARCHITECTURES.get(getattr(model.config, "model_type", None))
    if spec is None:
        return None
    try:
        arch = importlib.import_module(spec[0])
    except ImportError:  # pragma: no cover - a transformers without this architecture
        return None
    prefix = spec[1]
    cls = lambda name: getattr(arch, prefix + name, None)  # noqa: E731
    if type(model) is not cls("ForCausalLM") or type(model.model) is not cls("Model"):
        return None
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or model.training:
        return None
    decoder = list(model.model.layers[: config.num_hidden_layers])
    norm = cls("RMSNorm")
    if not decoder or type(model.model.norm) is not norm or any(
        type(layer) is not cls("DecoderLayer")
        or type(layer.self_attn) is not cls("Attention")
        or type(layer.mlp) is not cls("MLP")
        or type(layer.input_layernorm) is not norm
        or type(layer.post_attention_layernorm) is not norm
        or tuple(map(type, _head_norms(layer.self_attn))) not in ((), (norm, norm))
        for layer in decoder
    ):
        return None
    # A sliding window masks old columns by position; the lean mask has no notion of it.
    if getattr(config, "layer_types", None):
        if any(t != "full_attention" for t in config.layer_types):
            return None
    elif getattr(config, "sliding_window", None) is not None:
        return None
    # Hooks (accelerate's offloading, user forward hooks) change what a module call does; the
    # lean pass calls the modules too, but skips the model-level forward that hooks may wrap.
    for module in model.modules():
        if getattr(module, "_hf_hook", None) is not None or module._forward_hooks or module._forward_pre_hooks:
            return None
    return arch
