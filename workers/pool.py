"""The KV-cache pool of :class:`~workers.hf.HFWorker`: the sequences a worker scores, as rows
of one persistent batched cache (a :class:`~workers.kvcache.KVCache`).

Per layer, preallocated key/value buffers ``[rows, heads, capacity, head_dim]`` written in place;
a ``[rows, columns]`` validity mask; per row, the sequence it serves and the columns holding its
positions. A pass appends every row's new tokens at the same new columns (a shorter row gets
masked pads); a row rolls back by marking its columns invalid (attention over them weighs exactly
zero: a row's logits are its sequence's alone). Compacting holes, prefilling a joining sequence,
settling a pending tree: docs/engine.md, "Batches underneath" and "Trees".
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from workers.base import host_logits
from workers.kvcache import Forward, KVCache, Trees, buffer_layer, move_columns, num_layers
from workers.trees import Pending, accepted_path, window_mask
from workers.trees import positions as node_offsets  # a tree node's position after its prefix


class Pool(KVCache):
    """The worker's sequences as rows of one batched KV cache (see the module docstring).

    Per row: the cache columns holding its positions' keys/values, in order (``cols``, one a
    position); ``valid[r, c]`` says whether column ``c`` of row ``r`` holds one of them. Columns
    ``[0, used)`` are in use; the buffers have room for ``capacity``. A released sequence frees
    its row for the next one to join.
    """

    def __init__(self, model: Any, device: torch.device, context_length: int | None, forward: Forward):
        # what the pool needs of its worker: the model (its cache layout), where it runs, how many
        # positions it takes, and its forward pass over the pool's cache layers
        self.model, self.device, self.context_length, self.forward = model, device, context_length, forward
        self.told: dict[str, int] = {}  # seq_id -> what it holds, for its next pass (hold)
        self._clear()

    def _clear(self) -> None:
        """No rows and no buffers (freed)."""
        self.kbufs: list[torch.Tensor] | None = None  # per layer [rows, heads, capacity, head_dim]
        self.vbufs: list[torch.Tensor] | None = None
        self.layers: list | None = None  # cache layers over the buffers, reused while they last
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [rows, capacity]
        self.used = 0
        self.rows: list[str | None] = []  # seq_id per row; None: free
        self.row_of: dict[str, int] = {}
        self.cols: list[list[int]] = []
        self.trees: dict[int, Pending] = {}  # row -> its scored tree, until its next call settles it

    # -- shape management ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def _pad(self, rows: int = 0, columns: int = 0) -> None:
        """``rows`` more rows (free) and ``columns`` more columns, zeroed: masked columns are read too."""
        pad = torch.nn.functional.pad
        self.valid = pad(self.valid, (0, columns, 0, rows))
        if self.kbufs is not None:
            self.kbufs = [pad(b, (0, 0, 0, columns, 0, 0, 0, rows)) for b in self.kbufs]
            self.vbufs = [pad(b, (0, 0, 0, columns, 0, 0, 0, rows)) for b in self.vbufs]
            self.layers = None
        self.rows.extend([None] * rows)
        self.cols.extend([] for _ in range(rows))

    def _rebuild(self, keep_rows: list[int], capacity: int) -> None:
        """Keep only ``keep_rows`` (in that order) and each one's valid columns, gathered to the
        right end of ``[0, used)`` (left padding), in buffers of ``capacity`` columns."""
        dev = self.device
        held = {r: self._held(r) for r in keep_rows}  # a pending tree's nodes move along, after the row's tokens
        width = max((len(h) for h in held.values()), default=0)
        capacity = max(capacity, width)
        index = torch.zeros(len(keep_rows), width, dtype=torch.long, device=dev)
        valid = torch.zeros(len(keep_rows), capacity, dtype=torch.bool, device=dev)
        for i, r in enumerate(keep_rows):
            n = len(held[r])
            if n:
                index[i, width - n:] = torch.tensor(held[r], dtype=torch.long)
                valid[i, width - n:width] = True
            self.cols[r] = list(range(width - n, width - n + len(self.cols[r])))
            if r in self.trees:
                self.trees[r].start = width - len(self.trees[r].tokens)
        if self.kbufs is not None:
            rows = torch.tensor(keep_rows, dtype=torch.long, device=dev)
            all_rows = keep_rows == list(range(len(self.rows)))

            def gather(buf):
                idx = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                if all_rows and capacity == buf.shape[2]:
                    # compaction only: in place (the gather reads into a new tensor first), much
                    # cheaper than new buffers; columns past ``width`` are never read before written
                    if width:
                        buf[:, :, :width] = buf.gather(2, idx)
                    return buf
                new = buf.new_zeros((len(keep_rows), buf.shape[1], capacity, buf.shape[3]))
                if width:
                    picked = buf if all_rows else buf.index_select(0, rows)  # [R', H, C, D]
                    new[:, :, :width] = picked.gather(2, idx)
                return new

            self.kbufs = [gather(b) for b in self.kbufs]
            self.vbufs = [gather(b) for b in self.vbufs]
            self.layers = None
        self.valid = valid
        self.used = width
        self.rows = [self.rows[r] for r in keep_rows]
        self.cols = [self.cols[r] for r in keep_rows]
        self.trees = {i: self.trees[r] for i, r in enumerate(keep_rows) if r in self.trees}
        self.row_of = {s: i for i, s in enumerate(self.rows) if s is not None}

    def _held(self, r: int) -> list[int]:
        """The columns row ``r`` holds: its tokens', then its pending tree's nodes'."""
        tree = self.trees.get(r)
        if tree is None:
            return self.cols[r]
        return self.cols[r] + list(range(tree.start, tree.start + len(tree.tokens)))

    def _make_room(self, width: int) -> None:
        """Room for ``width`` more columns: compact if most columns are holes, else grow."""
        longest = max((len(self._held(r)) for r in range(len(self.rows))), default=0)
        holes = self.used - longest
        if holes > 16 and 4 * holes > self.used:
            self._rebuild(list(range(len(self.rows))), max(self.capacity, longest + width))
        if self.used + width > self.capacity:  # with headroom: growing copies the cache
            self._pad(columns=max(2 * self.capacity, 2 * (self.used + width), 64) - self.capacity)

    def hold(self, seq_ids, held) -> None:
        # applied by the sequences' next pass as it begins: after seating them, whose compaction
        # must find the columns that pass does (the same layout, the same sums)
        self.told.update(zip(seq_ids, held))

    @torch.inference_mode()  # the pool's tensors are inference tensors
    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self.told.pop(s, None)
            r = self.row_of.pop(s, None)
            if r is None:
                continue
            self.rows[r] = None
            self.cols[r] = []
            self.trees.pop(r, None)
            self.valid[r] = False
        if not self.row_of:
            self._clear()  # nothing left: free the buffers

    # -- one forward pass ---------------------------------------------------------------------

    def score(self, seq_ids, token_ids, num_positions, trees: Trees = None) -> list[torch.Tensor]:
        """:meth:`KVCache.score <workers.kvcache.KVCache.score>` for sequences of the pool (those
        new to it join): reconcile each row with its tokens, then one forward pass over all rows,
        feeding each its tail (and its tree's nodes)."""
        rows, news = self._begin("score", seq_ids, token_ids, num_positions)
        self._feed_long_rows_first(rows, news, num_positions)
        if trees is None:
            return self._forward(rows, news, num_positions)
        return self._forward(rows, [new + list(tree[0]) for new, tree in zip(news, trees)],
                             [len(tree[0]) + 1 for tree in trees], trees=trees)

    def prefill(self, seq_ids, token_ids) -> None:
        """:meth:`Worker.prefill <workers.base.Worker.prefill>` for sequences of the pool (those
        new to it join): each row's uncached tokens in a pass of these rows alone, logits dropped.
        A chunk of a long prompt fed in a pass of every row would widen the others' pass to its
        length."""
        self._feed_apart(*self._begin("prefill", seq_ids, token_ids, [1] * len(seq_ids)))

    def _begin(self, call: str, seq_ids, token_ids, num_positions) -> tuple[list[int], list[list[int]]]:
        """Each sequence's row, reconciled (:meth:`_reconcile`), and the tokens it still has to feed."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{call}: a sequence appears twice in one call")
        rows = self._seat(seq_ids)
        return rows, self._reconcile(rows, token_ids, num_positions)

    def _feed_apart(self, rows: list[int], news: list[list[int]]) -> None:
        """Feed these rows their ``news`` in passes of their own, logits dropped; a row that holds
        nothing yet fills columns it does not use (no holes for the others), as a sequence
        joining a running batch does."""
        fresh = [i for i, r in enumerate(rows) if not self.cols[r] and self.kbufs is not None
                 and len(news[i]) <= self.used]
        if fresh:
            self._prefill_fresh([rows[i] for i in fresh], [news[i] for i in fresh])
        others = [i for i in range(len(rows)) if i not in fresh]
        if others:
            self._forward([rows[i] for i in others], [news[i] for i in others], [1] * len(others), subset=True)

    def _seat(self, seq_ids) -> list[int]:
        """Each sequence's row; joining ones take free rows first, then new ones."""
        joining = [s for s in seq_ids if s not in self.row_of]
        if joining:
            free = [r for r, s in enumerate(self.rows) if s is None]
            if len(free) < len(joining):
                self._pad(rows=len(joining) - len(free))
                free = [r for r, s in enumerate(self.rows) if s is None]
            for s, r in zip(joining, free):
                self.rows[r] = s
                self.row_of[s] = r
        # Rows still free after the joins (sequences left, none waiting: the batch is draining)
        # would take part in every pass as padding: once they are a quarter of the rows, drop
        # them (which also compacts the columns). A geometric rule: few rebuilds as it drains.
        free = len(self.rows) - len(self.row_of)
        if free and 4 * free >= len(self.rows):
            self._rebuild([r for r, s in enumerate(self.rows) if s is not None], self.capacity)
        return [self.row_of[s] for s in seq_ids]

    def _reconcile(self, rows: list[int], token_ids, num_positions) -> list[list[int]]:
        """Keep what each row holds of the tokens it is handed (:meth:`hold`), its pending tree
        settled against them (dropped where it rolled back past the tree), and leave the positions
        that need logits uncached; return the tokens each row still has to feed."""
        told = [self.told.pop(self.rows[r], len(self.cols[r])) for r in rows]
        if self.trees:
            self._settle(rows, [None if n < len(self.cols[r]) else t for r, n, t in zip(rows, told, token_ids)])
        news, drops = [], []
        for r, toks, n, held in zip(rows, token_ids, num_positions, told):
            if not 1 <= n <= len(toks):
                raise ValueError(f"num_positions={n} for a sequence of {len(toks)} tokens")
            keep = min(held, len(self.cols[r]), len(toks) - n)
            drops.extend((r, c) for c in self.cols[r][keep:])
            del self.cols[r][keep:]
            news.append(list(toks[keep:]))
        self._invalidate(drops)
        return news

    def _invalidate(self, cells: list[tuple[int, int]]) -> None:
        """Mark these ``(row, column)`` cells of the cache invalid."""
        if cells:
            rows, cols = zip(*cells)
            self.valid[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = False

    def _settle(self, rows: list[int], token_ids) -> None:
        """Resolve the pending trees of these rows against the tokens they are handed now
        (:func:`~workers.trees.accepted_path`; None: drop the tree): each keeps the path its
        sequence took, moved to the columns right after its tail, and drops its other nodes;
        then ``used`` shrinks to the last column any row still holds."""
        moves, drops = [], []
        for r, toks in zip(rows, token_ids):
            tree = self.trees.pop(r, None)
            if tree is None:
                continue
            path = [] if toks is None else accepted_path(tree.tokens, tree.parents, toks, len(self.cols[r]))
            moves.extend((r, tree.start + i, tree.start + j) for j, i in enumerate(path) if i != j)
            drops.extend((r, c) for c in range(tree.start + len(path), tree.start + len(tree.tokens)))
            self.cols[r].extend(range(tree.start, tree.start + len(path)))
            if self.features is not None:
                self.features.settle(self.rows[r], path)
        if moves:
            move_columns(self.kbufs + self.vbufs, moves)
        self._invalidate(drops)
        end = max((c[-1] + 1 for c in self.cols if c), default=0)
        end = max([end] + [t.start + len(t.tokens) for t in self.trees.values()])
        self.used = min(self.used, end)

    def _feed_long_rows_first(self, rows: list[int], news: list[list[int]], num_positions) -> None:
        """A few rows with much more to feed than the others (a sequence joining a running batch)
        would widen every row's pass to their length: feed most of theirs first, by themselves,
        leaving in ``news`` what the common pass still feeds them."""
        width = max(len(new) for new in news)
        if self.kbufs is None or width <= 8 or len(rows) <= 1:
            return
        typical = sorted(len(new) for new in news)[len(news) // 2]
        long = [i for i, new in enumerate(news)
                if len(new) > max(8, 4 * typical) and len(new) > max(typical, num_positions[i])]
        if not long or 2 * len(long) > len(rows):
            return
        tails = [max(typical, num_positions[i]) for i in long]
        self._feed_apart([rows[i] for i in long], [news[i][:-t] for i, t in zip(long, tails)])
        for i, t in zip(long, tails):
            news[i] = news[i][-t:]

    def _window(self, news: list[list[int]], starts: list[int], width: int):
        """A pass's input window of ``width`` columns: (input ids, position ids, which columns hold
        a real token), one row per ``news``. Each row's new tokens end the window (pads first), so
        that every row's last token is at the window's end (logits are kept for the last
        positions only); positions count the row's valid tokens on from ``starts``."""
        input_ids = torch.tensor([[0] * (width - len(new)) + list(new) for new in news], dtype=torch.long)
        offsets = torch.tensor([width - len(new) for new in news], dtype=torch.long)
        window = torch.arange(width)
        positions = (torch.tensor(starts, dtype=torch.long) - offsets)[:, None] + window
        positions.clamp_(min=0)  # pad positions (masked anyway) clamped into range
        if self.context_length:
            positions.clamp_(max=self.context_length - 1)
        return input_ids, positions, window[None, :] >= offsets[:, None]

    def _prefill_fresh(self, rows: list[int], heads: list[list[int]]) -> None:
        """Prefill rows that hold nothing yet (sequences joining a running batch) by themselves,
        in a cache of their own, and write their keys/values into the columns just before
        ``used``, which their rows do not use. Appending them as new columns instead would leave
        every other row that many holes to attend over and compact away."""
        dev = self.device
        width = max(len(h) for h in heads)
        input_ids, positions, mask = self._window(heads, [0] * len(heads), width)
        layers = [buffer_layer(None, None, 0) for _ in self.kbufs]
        self.forward(input_ids.to(dev), positions.to(dev), layers, mask.to(dev), 1)
        if self.features is not None:  # each head ends the window; the rows held nothing before
            for i, (r, h) in enumerate(zip(rows, heads)):
                self.features.record(self.rows[r], 0, self.features.last[i], width - len(h), len(h))
        used = self.used
        for layer, k, v in zip(layers, self.kbufs, self.vbufs):
            for i, (r, h) in enumerate(zip(rows, heads)):
                k[r, :, used - len(h):used] = layer.kbuf[i, :, width - len(h):width]
                v[r, :, used - len(h):used] = layer.vbuf[i, :, width - len(h):width]
        for r, h in zip(rows, heads):
            self.valid[r, used - len(h):used] = True
            self.cols[r] = list(range(used - len(h), used))

    def _forward(self, rows: list[int], news: list[list[int]], num_positions, subset: bool | None = None,
                 trees=None):
        """One forward pass feeding ``news[i]`` to row ``rows[i]``; logits of each one's last
        ``num_positions[i]`` positions. With ``trees``, ``news[i]`` ends with the nodes of
        ``trees[i]`` (tokens, parents), which get their own positions, a tree mask among the
        new columns, and stay pending (:meth:`_settle`)."""
        dev = self.device
        width = max(len(new) for new in news)
        self._make_room(width)
        used = self.used
        # All rows take part (idle ones with masked pads: no copy), unless few do: then the
        # participants' rows are gathered into a temporary cache and their new columns copied back.
        if subset is None:
            subset = 3 * len(rows) < len(self.rows)
        subset = subset and self.kbufs is not None
        batch_rows = rows if subset else list(range(len(self.rows)))
        index = torch.tensor(rows, dtype=torch.long, device=dev) if subset else None
        slot = {r: i for i, r in enumerate(batch_rows)}
        fed: list[list[int]] = [[] for _ in batch_rows]  # idle rows: all pads
        for r, new in zip(rows, news):
            fed[slot[r]] = new
        input_ids, positions, new_valid = self._window(fed, [len(self.cols[r]) for r in batch_rows], width)
        among = None
        if trees is not None:
            among = torch.ones(width, width, dtype=torch.bool).tril().repeat(len(batch_rows), 1, 1)
            for r, new, (nodes, parents) in zip(rows, news, trees):
                if nodes:
                    n, i = len(nodes), slot[r]
                    among[i] = window_mask(width, width - n, parents)
                    positions[i, width - n:] = len(self.cols[r]) + len(new) - n + torch.tensor(node_offsets(parents))
            if self.context_length:
                positions.clamp_(max=self.context_length - 1)
            among = among.to(dev)
        layers, mask = self._pass_cache(index, new_valid.to(dev), width)
        keep = max(num_positions)  # logits only for the last positions any row needs
        # A small cache is copied to contiguous keys/values for attention (cheaper than the
        # strided read); a large one is read in place (a copy would cost more than it saves).
        compact = len(batch_rows) * (used + width) <= 4096
        for layer in layers:
            layer.compact_views = compact
        logits_all = host_logits(self.forward(input_ids.to(dev), positions.to(dev), layers, mask, keep, among))
        self._keep_new_columns(layers, index, new_valid, width)
        self.used = used + width
        results = []
        for i, (r, new, n) in enumerate(zip(rows, news, num_positions)):
            end = used + width
            tree = None
            if trees is not None and trees[i][0]:  # the nodes stay pending, after the row's tail
                tree = trees[i]
                end -= len(tree[0])
                self.trees[r] = Pending(list(tree[0]), list(tree[1]), end)
                new = new[:len(new) - len(tree[0])]
            if self.features is not None:  # the row's new tokens (then its tree's nodes) end the window
                self.features.record(self.rows[r], len(self.cols[r]), self.features.last[slot[r]],
                                     end - used - len(new), len(new), tree)
            self.cols[r].extend(range(end - len(new), end))
            results.append(logits_all[slot[r], keep - n:keep])
        return results

    def _pass_cache(self, index: torch.Tensor | None, new_valid: torch.Tensor, width: int):
        """The cache layers a pass writing ``width`` new columns runs on, and its attention mask
        ``[rows, used + width]``: the pool's own buffers, written in place, or (``index``: the
        rows taking part) a gathered copy of those rows. ``new_valid`` says which new columns
        hold a real token."""
        used = self.used
        self.valid[:, used:used + width] = False
        if index is not None:
            self.valid[index, used:used + width] = new_valid
            mask = self.valid.index_select(0, index)[:, :used + width]
            return [buffer_layer(k.index_select(0, index), v.index_select(0, index), used)
                    for k, v in zip(self.kbufs, self.vbufs)], mask
        self.valid[:, used:used + width] = new_valid
        mask = self.valid[:, :used + width]
        if self.kbufs is None:  # the first pass: the layers allocate the buffers
            layers = [buffer_layer(None, None, 0) for _ in range(num_layers(self.model))]
            for layer in layers:
                layer.capacity = self.capacity
            return layers, mask
        if self.layers is None:
            self.layers = [buffer_layer(k, v, used) for k, v in zip(self.kbufs, self.vbufs)]
        for layer in self.layers:
            layer.length = used
        return self.layers, mask

    def _keep_new_columns(self, layers, index: torch.Tensor | None, new_valid: torch.Tensor, width: int) -> None:
        """After a pass: the new columns into the pool's buffers (copied back from a gathered
        copy; adopted from the layers of the first pass), pad columns zeroed."""
        used = self.used
        if not bool(new_valid.all()):  # pad columns hold junk: zero it, so that nothing non-finite can ever sit in the cache
            junk = ~new_valid.to(self.device)[:, None, :, None]
            for layer in layers:
                layer.kbuf.narrow(2, used, width).masked_fill_(junk, 0)
                layer.vbuf.narrow(2, used, width).masked_fill_(junk, 0)
        if index is not None:
            for layer, k, v in zip(layers, self.kbufs, self.vbufs):
                k[index, :, used:used + width] = layer.kbuf[:, :, used:used + width]
                v[index, :, used:used + width] = layer.vbuf[:, :, used:used + width]
        elif self.kbufs is None:
            self.kbufs = [layer.kbuf for layer in layers]
            self.vbufs = [layer.vbuf for layer in layers]
            self.layers = layers
