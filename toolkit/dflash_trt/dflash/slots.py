"""A KV cache for a batch of sequences that each have their own length (continuous batching).

Each layer's keys and values live in one buffer (rows, kv_heads, capacity, head_dim); row r holds
its sequence's positions 0 .. length[r]-1 at slots 0 .. length[r]-1, so a slot index is a
position. A forward over rows lo..hi-1 with T new tokens per row writes them at each row's own
length (`SlotView`), and every query attends to the slots before it in its own row: the mask is
`slot <= length[r] + t`. Rows that bring fewer than T real tokens are padded; the padding writes
past the row's length, where nothing reads it and the next forward overwrites it. After a
verify forward the caller sets each row's length to what it accepted (a per-row crop).

Active rows are kept contiguous (0 .. n-1) so a batched forward reads views, not gathers: a
finished row's slot is refilled by moving the last row into it (`move`).

Rows that bring different numbers of new tokens (one verifies 6 drafts, the others none) can run
packed instead (`PackedView`): their tokens side by side in one sequence, so the linear layers,
most of a forward's cost, see only real tokens. Attention alone runs padded, through the same
mask and kernel as a SlotView of the widest row of at most WIDE tokens; a wider row (a prompt
chunk) attends on its own (dflash.attention's `packed` argument).
"""

from __future__ import annotations

import torch


class SlotCache:
    """Keys and values of up to `rows` sequences, `capacity` positions each, per layer."""

    def __init__(self, num_layers: int, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.lengths = [0] * rows  # valid positions per row
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # (rows, nkv, capacity, hd)
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def view(self, lo: int, hi: int, width: int) -> SlotView:
        """Rows lo..hi-1, each about to receive `width` new positions at its length."""
        top = max(self.lengths[lo:hi]) + width
        if top > self.capacity:
            raise ValueError(f"slot cache full: {top} positions > capacity {self.capacity}")
        return SlotView(self, lo, hi, width)

    def packed(self, lo: int, hi: int, counts: list[int]) -> PackedView:
        """Rows lo..hi-1, row lo + i about to receive counts[i] new positions (0 for none)."""
        view = PackedView(self, lo, hi, counts)
        if view.top > self.capacity:
            raise ValueError(f"slot cache full: {view.top} positions > capacity {self.capacity}")
        return view

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's (src's slot is free afterwards)."""
        n = self.lengths[src]
        for buf in (*self._keys, *self._values):
            if buf is not None:
                buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def take(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of row's first n positions per layer: (nkv, n, hd) keys and values each."""
        return [None if keys is None else (keys[row, :, :n].clone(), values[row, :, :n].clone())
                for keys, values in zip(self._keys, self._values, strict=True)]

    def put(self, row: int, layers: list[tuple[torch.Tensor, torch.Tensor] | None],
            n: int) -> None:
        """Row's first n positions from `take`'s copies (of a sequence that starts as this row's
        does); the row's length becomes n."""
        for layer, saved in enumerate(layers):
            if saved is not None:
                keys, values = self.layer(layer, saved[0][None])
                keys[row, :, :n], values[row, :, :n] = saved[0][:, :n], saved[1][:, :n]
        self.lengths[row] = n

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers, allocated on first use in the shape and dtype of `like`."""
        if self._keys[layer] is None:
            shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
            self._keys[layer], self._values[layer] = like.new_zeros(shape), like.new_zeros(shape)
        return self._keys[layer], self._values[layer]


class SlotView:
    """What one forward over rows lo..hi-1 sees: the Hugging Face cache protocol (`update`) plus
    the positions and mask of its new tokens."""

    def __init__(self, cache: SlotCache, lo: int, hi: int, width: int):
        self.cache, self.lo, self.hi, self.width = cache, lo, hi, width
        self.starts = cache.lengths[lo:hi]  # (n,) where each row's new tokens go
        self.top = max(self.starts) + width  # slots any row of this forward may read

    def positions(self, device) -> torch.Tensor:
        """(n, width) position of each new token."""
        start = torch.tensor(self.starts, device=device)[:, None]
        return start + torch.arange(self.width, device=device)[None]

    def causal_mask(self, device) -> torch.Tensor | None:
        """(n, 1, width, top) bool: new token t of row r sees slots <= start[r] + t; None when
        every row starts at the same slot, where the model's own causal mask over this cache
        (`get_mask_sizes`, `get_query_offset`) is the same one. Without a mask, attention takes
        its fast paths (no mask at one new token, grouped KV heads without copies)."""
        if len(set(self.starts)) == 1:
            return None
        slots = torch.arange(self.top, device=device)[None, None]  # (1, 1, top)
        return (slots <= self.positions(device)[:, :, None])[:, None]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (n, nkv, width, hd) at each row's start; return (n, nkv, top, hd) views."""
        keys, values = self.cache.layer(layer, k)
        for i, start in enumerate(self.starts):  # a slice copy per row: n is small
            keys[self.lo + i, :, start:start + self.width] = k[i]
            values[self.lo + i, :, start:start + self.width] = v[i]
        return keys[self.lo:self.hi, :, :self.top], values[self.lo:self.hi, :, :self.top]

    def update(self, key_states, value_states, layer_idx: int, *_args, **_kwargs):
        """The transformers Cache call each attention layer makes."""
        return self.write(layer_idx, key_states, value_states)

    def get_seq_length(self, _layer: int = 0) -> int:
        return self.top - self.width

    def get_query_offset(self, _layer: int = 0) -> int:
        """transformers' mask protocol: where the new tokens start (the same in every row)."""
        return self.top - self.width

    def get_mask_sizes(self, query_length: int, _layer: int = 0) -> tuple[int, int]:
        """transformers' mask protocol: (keys attended, offset of the first)."""
        return self.top - self.width + query_length, 0


class PackedView(SlotView):
    """A forward whose rows bring counts[i] new tokens each, packed row after row into one
    sequence (1, sum(counts)): ids, positions, hidden states and features are packed (row i's
    tokens at offsets[i] .. offsets[i] + counts[i]), and the keys and values land in each row's
    own slots. Attention (dflash.attention's `packed`) runs the rows of at most WIDE tokens (a
    verify block) padded to the widest of them (`width`, `causal_mask`), and each wider row (a
    prompt chunk) on its own, so a chunk of 500 tokens does not pad its neighbours to 500."""

    WIDE = 16

    def __init__(self, cache: SlotCache, lo: int, hi: int, counts: list[int]):
        super().__init__(cache, lo, hi, max([c for c in counts if c <= self.WIDE] or [1]))
        self.counts = list(counts)
        # The slots any real token reads: a short prompt chunk may widen the padded pass past a
        # verify row's room at the end of its cache, but its padding queries are dropped.
        self.top = max(s + c for s, c in zip(self.starts, counts, strict=True))
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]
        self.wide = [i for i, c in enumerate(counts) if c > self.WIDE]
        rows = [i for i, c in enumerate(counts) for _ in range(c)]
        cols = [t for c in counts for t in range(c)]
        self.rows, self.cols = torch.tensor(rows), torch.tensor(cols)  # (T,) each token's place
        self.slots = torch.tensor(self.starts)[self.rows] + self.cols  # (T,) and its position
        # the tokens of the padded pass: every token of the rows that are not wide
        self.narrow = torch.tensor([t for t, r in enumerate(rows) if counts[r] <= self.WIDE],
                                   dtype=torch.long)

    def positions(self, device) -> torch.Tensor:
        """(1, T) position of each new token."""
        return self.slots[None].to(device)

    def causal_mask(self, device) -> torch.Tensor:
        """(n, 1, width, top) bool: the padded pass's mask, as a SlotView of `width`'s."""
        slots = torch.arange(self.top, device=device)[None, None]  # (1, 1, top)
        return (slots <= super().positions(device)[:, :, None])[:, None]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (n, width, ...): the narrow rows' tokens in the padded pass's layout."""
        out = packed.new_zeros(self.hi - self.lo, self.width, *packed.shape[1:])
        narrow = self.narrow.to(packed.device)
        out[self.rows[self.narrow].to(packed.device), self.cols[self.narrow].to(packed.device)] \
            = packed[narrow]
        return out

    def unpad(self, padded: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Copy the narrow rows' tokens from (n, width, ...) into their places in (T, ...)."""
        narrow = self.narrow.to(padded.device)
        into[narrow] = padded[self.rows[self.narrow].to(padded.device),
                              self.cols[self.narrow].to(padded.device)]
        return into

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write packed k, v (1, nkv, T, hd) into each token's slot; return (n, nkv, top, hd)
        views as SlotView.write does."""
        keys, values = self.cache.layer(layer, k)
        rows, slots = (self.rows + self.lo).to(k.device), self.slots.to(k.device)
        keys[rows, :, slots] = k[0].transpose(0, 1)  # (T, nkv, hd) at (row, slot)
        values[rows, :, slots] = v[0].transpose(0, 1)
        return keys[self.lo:self.hi, :, :self.top], values[self.lo:self.hi, :, :self.top]
