"""The local engine's model steps: prefill new rows, decode one token for every running row.

Two implementations of one small interface (worker-thread state; rows are the running
requests in order, ``state`` is the opaque KV cache of those rows, ``None`` when empty):

    state, logits_NV = decoder.prefill(state, contexts)  # appends len(contexts) rows
    logits_BV = decoder.decode(state, tokens_B)           # one token per row
    state, order = decoder.keep_rows(state, keep)          # drop the other rows; order: old row
                                                           # indices in the new row order

* :class:`SlotDecoder` (the default for Llama / Qwen2 / Mistral / Qwen3 dense layouts; Qwen3's
  per-head RMSNorm of queries and keys, ``q_norm`` / ``k_norm``, runs before the rotary
  embedding as in the HF forward): the KV cache is
  one preallocated buffer per K and V, ``[layers, slots, kv_heads, capacity, head_dim]``;
  row ``b``'s tokens sit in columns ``0 .. len_b - 1`` of slot ``b`` (no left padding), the
  new token's K/V is written in place, capacity grows by doubling (amortised O(1) per
  token), and finished rows are replaced by rows moved from the tail (no re-packing). The
  decode step calls the model's own norm, MLP, rotary and projection modules layer by
  layer and SDPA over the cached columns (a key-padding mask only when rows differ in
  length), so it computes what the HF forward computes, without the HF forward's per-step
  mask building, cache bookkeeping and ``torch.cat`` of the whole cache; its products run
  over weight copies laid out for the step's row count (see the class docstring).
* :class:`HFDecoder` (any other architecture, Qwen3-MoE included, and the previous implementation kept for
  ``bench/bench_engine.py``): the HF forward with a ``DynamicCache``, left-padded rows,
  an attention mask grown by one column per step, rows joined by padding and
  concatenating the caches.

Prefill: the HF decoder runs the HF forward (left-padded, per-row position ids, logits of the
last position only); the slot decoder runs its own ragged prefill (every new context's tokens
in one batch without padding, each product once over all of them, causal SDPA per row with the
row's K/V written straight into its slot, logits of each context's last position only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Decoder layers whose attention is q/k/v/o projections + rotary (Qwen3: after a per-head q/k
# RMSNorm), pre-norm residual blocks with a dense SwiGLU MLP, a final norm and an lm_head: what
# SlotDecoder re-implements step-wise.
SLOT_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral", "qwen3"})
QK_NORM_MODEL_TYPES = frozenset({"qwen3"})


def supports_slot_decoder(model) -> bool:
    config = model.config
    if getattr(config, "model_type", None) not in SLOT_MODEL_TYPES:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False  # full attention only (the engine refuses other cache layers anyway)
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
    if config.model_type in QK_NORM_MODEL_TYPES:
        names += ("q_norm", "k_norm")
    return all(hasattr(attn, name) for name in names)


def _prefill_hf(model, contexts: list[list[int]], device: torch.device):
    """HF forward over left-padded contexts; returns (DynamicCache, mask_BT, logits_BV)."""
    from transformers.cache_utils import DynamicCache

    width = max(len(c) for c in contexts)
    ids_BT = torch.zeros(len(contexts), width, dtype=torch.long)
    mask_BT = torch.zeros(len(contexts), width, dtype=torch.long)
    for row, context in enumerate(contexts):
        n = len(context)
        ids_BT[row, width - n:] = torch.tensor(context)
        mask_BT[row, width - n:] = 1
    ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
    position_BT = (mask_BT.cumsum(dim=1) - 1).clamp_(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_BT, cache=cache,
                use_cache=True, logits_to_keep=1)
    return out.cache, mask_BT, out.logits[:, -1, :]


# ---------------------------------------------------------------------------- HF forward


@dataclass(slots=True)
class HFState:
    cache: object  # transformers DynamicCache, left-padded rows
    mask_BT: torch.Tensor  # 1 where a cached column holds a real token of that row
    next_pos_B: torch.Tensor  # position id of each row's pending token


class HFDecoder:
    """The HF forward with a DynamicCache (see the module docstring)."""

    name = "hf"

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device

    def prefill(self, state: HFState | None, contexts: list[list[int]],
                reuse: list | None = None) -> tuple[HFState, torch.Tensor]:
        if reuse is not None and any(r is not None for r in reuse):
            raise ValueError("HFDecoder keeps no prefix cache (reuse is the slot decoder's)")
        cache, mask_BT, logits_NV = _prefill_hf(self.model, contexts, self.device)
        new = HFState(cache=cache, mask_BT=mask_BT, next_pos_B=mask_BT.sum(dim=1))
        return (new if state is None else self._merge(state, new)), logits_NV

    def decode(self, state: HFState, tokens_B: torch.Tensor) -> torch.Tensor:
        mask_BT = torch.cat([state.mask_BT, torch.ones_like(state.mask_BT[:, :1])], dim=1)
        out = self.model(input_ids=tokens_B[:, None], attention_mask=mask_BT, position_ids=state.next_pos_B[:, None],
                         cache=state.cache, use_cache=True)
        state.mask_BT = mask_BT
        state.next_pos_B = state.next_pos_B + 1
        return out.logits[:, -1, :]

    @staticmethod
    def _merge(old: HFState, new: HFState) -> HFState:
        """Join newly prefilled rows to the running rows (left-pad the shorter cache)."""
        from transformers.cache_utils import DynamicCache

        width = max(old.mask_BT.shape[1], new.mask_BT.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        layers = [(torch.cat([pad(a.keys, 2), pad(b.keys, 2)]), torch.cat([pad(a.values, 2), pad(b.values, 2)]))
                  for a, b in zip(old.cache.layers, new.cache.layers, strict=True)]
        return HFState(cache=DynamicCache(ddp_cache_data=layers),
                       mask_BT=torch.cat([pad(old.mask_BT, 1), pad(new.mask_BT, 1)]),
                       next_pos_B=torch.cat([old.next_pos_B, new.next_pos_B]))

    @torch.inference_mode()
    def keep_rows(self, state: HFState, keep: list[int]) -> tuple[HFState | None, list[int]]:
        """Keep only rows ``keep`` (in order) and trim all-padding columns."""
        if not keep:
            return None, []
        index = torch.tensor(keep, dtype=torch.long, device=state.mask_BT.device)
        mask_BT = state.mask_BT.index_select(0, index)
        start = int(mask_BT.any(dim=0).nonzero()[0])
        for layer in state.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        state.mask_BT = mask_BT[:, start:]
        state.next_pos_B = state.next_pos_B.index_select(0, index)
        return state, list(keep)


# ---------------------------------------------------------------------------- slot cache


# prefill reuse of a context's first n tokens: (a CachedPrefix or the index of an earlier context, n)
Reuse = tuple[object, int]


@dataclass(slots=True)
class SlotState:
    keys: torch.Tensor  # [layers, slots, kv_heads, capacity, head_dim]
    values: torch.Tensor
    lengths: list[int]  # cached tokens of each running row (= the position of its pending token)


class SlotDecoder:
    """Step-wise decode over preallocated per-row KV slots (see the module docstring).

    At construction the q/k/v and the gate/up projections of every layer are re-laid as
    row blocks of one contiguous matrix each (their parameters become views into it, so an
    in-place ``copy_`` of new weights still lands where the decode step reads it), which
    makes a layer four matmuls instead of seven. Its products run over one of two sets of weight
    copies (marked stale by ``weights_changed``, rebuilt once at the next step):

    * an engine built for more than ``small_rows`` rows, on CPU in float32: every weight reordered
      once into oneDNN's blocked layout (``_pack``, the op inductor's CPU weight freezing uses), each
      product oneDNN's float32 inner product, at every row count. A SmolLM2-135M step at 16 rows
      (AMD EPYC, 2 cores): 50 ms, the products at ~100 GFLOP/s, against ~80 ms split; at 1 row
      28 ms against 24 with the transposed copies below. ~540 MB for SmolLM2-135M.
    * otherwise (``pack=False``, no oneDNN, another dtype or device, or at most ``small_rows``
      rows): at one or two rows ``_split_inner`` over transposed copies (``_split_linear`` for
      down_proj), at more rows ``_split_linear``, each split across the torch threads. ~430 MB.
    """

    name = "slot"
    min_capacity = 128

    def __init__(self, model, device: torch.device, max_rows: int, pack: bool = True) -> None:
        if not supports_slot_decoder(model):
            raise ValueError(f"SlotDecoder does not cover {type(model).__name__}")
        self.model, self.device, self.max_rows = model, device, max_rows
        self.body = model.model
        attn = self.body.layers[0].self_attn
        config = model.config
        self.head_dim = int(attn.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(attn.scaling)
        self.qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        self.layers = list(self.body.layers[: config.num_hidden_layers])
        self.dtype = self.body.embed_tokens.weight.dtype
        self.fused = [(_fuse_rows([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                       _fuse_rows([layer.mlp.gate_proj, layer.mlp.up_proj])) for layer in self.layers]
        # Steps of more than `small_rows` rows on CPU in float32 (an engine built for more rows): every
        # product's weight reordered into oneDNN's blocked layout, used at every row count (None where
        # oneDNN cannot take it; rebuilt after weights_changed()).
        self.pack = pack and max_rows > self.small_rows and can_pack(device, self.dtype)
        self.packed: list[tuple[torch.Tensor, ...]] | None = None
        self.packed_lm_head: torch.Tensor | None = None
        # Otherwise, steps of at most `small_rows` rows read the q/k/v, o, gate/up and lm_head weights
        # from transposed copies (``[in, out]`` contiguous, rebuilt after weights_changed()): one of the
        # two sets of copies, never both (each is ~0.4-0.5 GB for SmolLM2-135M).
        self.small = self.small_lm_head = None
        if not self.pack:
            with torch.no_grad():
                self.small = [tuple(w.detach().t().contiguous() for w in sources) for sources in self._small_sources()]
                self.small_lm_head = model.lm_head.weight.detach().t().contiguous()
        self._pack_weights()
        # what weights_changed() marked: the written tensors' memory spans ([]: nothing; None: every copy)
        self._stale: list[tuple[int, int]] | None = []

    # At most this many rows, a step reads the q/k/v, o, gate/up and lm_head weights from the
    # transposed copies, split along the input dimension (``_split_inner``); down_proj (1536 in,
    # 576 out) stays split along its output rows (``_split_linear``), which was faster for it.
    # A SmolLM2-135M decode step, split by output rows vs this (medians of 8 interleaved
    # rounds of 4 steps, 2 cores): 34.2 vs 28.6 ms at 1 row, 64.1 vs 50.6 at 2, 59.8 vs 71.4
    # at 4 (the first seconds of a process: sustained, this CPU's clock drops; the ratios held in
    # bench/bench_engine.py). The copies cost ~430 MB for SmolLM2-135M in float32.
    small_rows = 2

    def _pack_sources(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer, the weights the packed copies hold: fused q/k/v, o, fused gate/up, down."""
        return [(qkv_w, layer.self_attn.o_proj.weight, gate_up_w, layer.mlp.down_proj.weight)
                for layer, ((qkv_w, _), (gate_up_w, _)) in zip(self.layers, self.fused, strict=True)]

    @torch.inference_mode()
    def _pack_weights(self, stale=lambda weight: True) -> None:
        """(Re)build the packed copy of every weight ``stale`` names (all, at construction)."""
        if not self.pack:
            return
        rows = self.max_rows  # oneDNN picks its blocking for this many rows; any count runs on it
        old = self.packed or [(None,) * 4] * len(self.layers)
        self.packed = [tuple(_pack(w, rows) if copy is None or stale(w) else copy for w, copy in zip(sources, copies))
                       for sources, copies in zip(self._pack_sources(), old, strict=True)]
        if self.packed_lm_head is None or stale(self.model.lm_head.weight):
            self.packed_lm_head = _pack(self.model.lm_head.weight, rows)

    def _small_sources(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer, the weights the transposed copies hold: fused q/k/v, o, fused gate/up."""
        return [(qkv_w, layer.self_attn.o_proj.weight, gate_up_w)
                for layer, ((qkv_w, _), (gate_up_w, _)) in zip(self.layers, self.fused, strict=True)]

    def weights_changed(self, changed: Iterable[torch.Tensor] | None = None) -> None:
        """Mark the transposed and packed copies of the weights just written in place as stale.

        ``changed``: the model's tensors that were written (any view of a weight names it: q_proj's
        weight names the fused q/k/v matrix, a tied embedding the lm_head: memory is compared);
        None: every weight. Nothing is rebuilt here: the next ``prefill`` or ``decode`` (or
        ``refresh``) rebuilds each stale copy once. A weight sync arrives in buckets (a fused
        matrix's parts may come in several), so a sync of any number of buckets costs one refresh
        of the copies it wrote, at the first step after it, and each bucket's load is a copy.
        """
        if changed is None or self._stale is None:  # every copy (now or already)
            self._stale = None
        else:
            self._stale.extend(_span(t) for t in changed)

    @torch.inference_mode()
    def refresh(self) -> None:
        """Rebuild the copies ``weights_changed`` marked stale (a no-op when none are)."""
        spans, self._stale = self._stale, []
        if spans == []:
            return

        def stale(weight: torch.Tensor) -> bool:  # the weight's memory overlaps a written tensor's
            if spans is None:
                return True
            start, end = _span(weight)
            return any(a < end and start < b for a, b in spans)

        if self.small is not None:
            for sources, copies in zip(self._small_sources(), self.small, strict=True):
                for source, copy in zip(sources, copies, strict=True):
                    if stale(source):
                        copy.copy_(source.t())
            if stale(self.model.lm_head.weight):
                self.small_lm_head.copy_(self.model.lm_head.weight.t())
        self._pack_weights(stale)

    def _reserve(self, state: SlotState | None, rows: int, longest: int) -> SlotState:
        """``state`` with room for ``rows`` slots of ``longest`` columns (capacity grows by doubling)."""
        have_rows = 0 if state is None else state.keys.shape[1]
        have_cap = 0 if state is None else state.keys.shape[3]
        if state is not None and rows <= have_rows and longest <= have_cap:
            return state
        capacity = max(have_cap, self.min_capacity)
        while capacity < longest:
            capacity *= 2
        shape = (len(self.layers), max(have_rows, self.max_rows, rows), self.kv_heads, capacity, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if state is None:
            return SlotState(keys=keys, values=values, lengths=[])
        n, used = len(state.lengths), max(state.lengths, default=0)
        keys[:, :n, :, :used] = state.keys[:, :n, :, :used]
        values[:, :n, :, :used] = state.values[:, :n, :, :used]
        state.keys, state.values = keys, values
        return state

    def prefill(self, state: SlotState | None, contexts: list[list[int]],
                reuse: list[Reuse | None] | None = None) -> tuple[SlotState, torch.Tensor]:
        """Append one row per context: every context's new tokens in one ragged batch (no padding),
        each product over all of them at once (the packed weights where the engine has them), causal
        attention row by row with its K/V written straight into the row's slot; logits of each
        context's last position only.

        ``reuse[i]`` (optional): ``(source, n)``, the first ``n`` tokens of context ``i`` (at most
        ``len - 1``) are not computed but their K/V taken from ``source``: a
        :class:`~megatron_tir.rollout.engines.prefix_cache.CachedPrefix` (copied into the slot
        first), or the index ``j < i`` of an earlier context of this call that starts with the same
        ``n`` tokens (copied from its slot layer by layer, once that layer's K/V are written)."""
        self.refresh()
        lengths = [len(c) for c in contexts]
        reuse = reuse or [None] * len(contexts)
        skip = [0 if r is None else r[1] for r in reuse]
        for i, (n, k, r) in enumerate(zip(lengths, skip, reuse, strict=True)):
            if not 0 <= k < n or (r is not None and isinstance(r[0], int) and not 0 <= r[0] < i):
                raise ValueError(f"prefill: bad reuse {r!r} for context {i} of length {n}")
        old = [] if state is None else state.lengths
        state = self._reserve(state, len(old) + len(contexts), max(lengths + old) + 1)
        first, heads, kv_heads, head_dim = len(old), self.heads, self.kv_heads, self.head_dim
        qk_heads, gqa, half = heads + kv_heads, heads != kv_heads, head_dim // 2
        news = [n - k for n, k in zip(lengths, skip)]
        ids_T = torch.tensor([t for c, k in zip(contexts, skip) for t in c[k:]], dtype=torch.long, device=self.device)
        pos_T = torch.cat([torch.arange(k, n, device=self.device) for n, k in zip(lengths, skip)])
        starts = [sum(news[:row]) for row in range(len(news))]
        tokens = len(ids_T)
        siblings = [(first + row, first + r[0], r[1]) for row, r in enumerate(reuse)
                    if r is not None and isinstance(r[0], int) and r[1]]
        for row, r in enumerate(reuse):
            if r is not None and not isinstance(r[0], int) and r[1]:
                state.keys[:, first + row, :, :r[1]] = r[0].keys[:, :, :r[1]]
                state.values[:, first + row, :, :r[1]] = r[0].values[:, :, :r[1]]
        masks = [None if k == 0 else  # key column c is visible to the query at position k + q iff c <= k + q
                 torch.arange(n, device=self.device)[None, :] <= torch.arange(k, n, device=self.device)[:, None]
                 for n, k in zip(lengths, skip)]

        hidden = self.body.embed_tokens(ids_T)  # [T, hidden]
        cos, sin = self.body.rotary_emb(hidden, position_ids=pos_T[None, :])  # [1, T, head_dim]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        packed = self.packed is not None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            (qkv_w, qkv_b), (gate_up_w, gate_up_b) = self.fused[i]
            o_w, down = (self.packed[i][1], self.packed[i][3]) if packed else (attn.o_proj.weight, mlp.down_proj.weight)
            if packed:
                qkv_w, gate_up_w = self.packed[i][0], self.packed[i][2]
            x = _rms_norm(layer.input_layernorm, hidden)
            qkv = _prefill_linear(x, qkv_w, qkv_b).view(tokens, qk_heads + kv_heads, head_dim)
            qk = _qk_norm(attn, qkv, heads, qk_heads) if self.qk_norm else qkv[:, :qk_heads]
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:]
            layer_keys, layer_values = state.keys[i], state.values[i]
            for row, (start, n, m) in enumerate(zip(starts, lengths, news, strict=True)):
                layer_keys[first + row, :, n - m:n].copy_(k[start:start + m].transpose(0, 1))
                layer_values[first + row, :, n - m:n].copy_(v[start:start + m].transpose(0, 1))
            for slot, source, n in siblings:  # in row order: a source's own columns are complete
                layer_keys[slot, :, :n] = layer_keys[source, :, :n]
                layer_values[slot, :, :n] = layer_values[source, :, :n]
            out = torch.empty(tokens, heads, head_dim, dtype=hidden.dtype, device=self.device)
            for row, (start, n, m) in enumerate(zip(starts, lengths, news, strict=True)):
                keys, values = layer_keys[first + row, :, :n], layer_values[first + row, :, :n]
                out[start:start + m] = F.scaled_dot_product_attention(
                    q[start:start + m].transpose(0, 1)[None], keys[None], values[None], attn_mask=masks[row],
                    is_causal=masks[row] is None, scale=self.scaling, enable_gqa=gqa)[0].transpose(0, 1)
            hidden = hidden + _prefill_linear(out.view(tokens, heads * head_dim), o_w, attn.o_proj.bias)
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gate, up = _prefill_linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
            hidden = hidden + _prefill_linear(mlp.act_fn(gate) * up, down, mlp.down_proj.bias)
        state.lengths = old + lengths
        last = torch.tensor([start + m - 1 for start, m in zip(starts, news)], device=self.device)
        hidden = _rms_norm(self.body.norm, hidden.index_select(0, last))
        return state, _prefill_linear(hidden, self.packed_lm_head if packed else self.model.lm_head.weight,
                                      self.model.lm_head.bias)

    @staticmethod
    def row_kv(state: SlotState, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s cached K/V, ``[layers, kv_heads, length, head_dim]`` each."""
        n = state.lengths[row]
        return state.keys[:, row, :, :n].clone(), state.values[:, row, :, :n].clone()

    def decode(self, state: SlotState, tokens_B: torch.Tensor) -> torch.Tensor:
        self.refresh()
        lengths = state.lengths
        rows, width = len(lengths), max(lengths) + 1
        self._reserve(state, rows, width)
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qk_heads, gqa, half = heads + kv_heads, heads != kv_heads, head_dim // 2
        pos_B = torch.tensor(lengths, dtype=torch.long, device=self.device)
        same_length = min(lengths) == max(lengths)
        if same_length:  # every row attends to all `width` columns; the new column is one slice
            mask, row_B, column = None, None, lengths[0]
        else:
            mask = (torch.arange(width, device=self.device)[None, :] <= pos_B[:, None])[:, None, None, :]
            row_B, column = torch.arange(rows, device=self.device), pos_B

        hidden = self.body.embed_tokens(tokens_B)  # [B, hidden]
        cos, sin = self.body.rotary_emb(hidden, position_ids=pos_B[:, None])  # [B, 1, head_dim]
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        small = self.small is not None and rows <= self.small_rows
        packed = self.packed is not None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            (qkv_w, qkv_b), (gate_up_w, gate_up_b) = self.fused[i]
            if small:
                qkv_t, o_t, gate_up_t = self.small[i]
                down = mlp.down_proj.weight
            elif packed:
                qkv_w, o_w, gate_up_w, down = self.packed[i]
            else:
                o_w, down = attn.o_proj.weight, mlp.down_proj.weight
            x = _rms_norm(layer.input_layernorm, hidden)
            qkv = _split_inner(x, qkv_t, qkv_b) if small else _linear(x, qkv_w, qkv_b)
            qkv = qkv.view(rows, qk_heads + kv_heads, head_dim)
            qk = _qk_norm(attn, qkv, heads, qk_heads) if self.qk_norm else qkv[:, :qk_heads]
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # RoPE on q and k at once
            k, v = qk[:, heads:], qkv[:, qk_heads:]
            layer_keys, layer_values = state.keys[i], state.values[i]
            if same_length:
                layer_keys[:rows, :, column].copy_(k)
                layer_values[:rows, :, column].copy_(v)
            else:
                layer_keys[row_B, :, column] = k
                layer_values[row_B, :, column] = v
            out = F.scaled_dot_product_attention(
                qk[:, :heads, None], layer_keys[:rows, :, :width], layer_values[:rows, :, :width],
                attn_mask=mask, scale=self.scaling, enable_gqa=gqa)  # [B, heads, 1, head_dim]
            out = out.reshape(rows, heads * head_dim)
            hidden = hidden + (_split_inner(out, o_t, attn.o_proj.bias) if small else _linear(out, o_w, attn.o_proj.bias))
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gate_up = _split_inner(x, gate_up_t, gate_up_b) if small else _linear(x, gate_up_w, gate_up_b)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + _linear(mlp.act_fn(gate) * up, down, mlp.down_proj.bias)
        state.lengths = [n + 1 for n in lengths]
        hidden = _rms_norm(self.body.norm, hidden)
        if small:
            return _split_inner(hidden, self.small_lm_head, self.model.lm_head.bias)
        return _linear(hidden, self.packed_lm_head if packed else self.model.lm_head.weight, self.model.lm_head.bias)

    @torch.inference_mode()
    def keep_rows(self, state: SlotState, keep: list[int]) -> tuple[SlotState | None, list[int]]:
        """Keep rows ``keep``; kept rows past the new end move into the holes below it.

        Returns the state and the new row order as old row indices.
        """
        rows = len(keep)
        if not rows:
            return None, []
        kept = set(keep)
        holes = [i for i in range(rows) if i not in kept]
        movers = [j for j in keep if j >= rows]
        order = list(range(rows))
        for hole, mover in zip(holes, movers, strict=True):
            used = state.lengths[mover]
            state.keys[:, hole, :, :used] = state.keys[:, mover, :, :used]
            state.values[:, hole, :, :used] = state.values[:, mover, :, :used]
            order[hole] = mover
        state.lengths = [state.lengths[j] for j in order]
        return state, order


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements lie in."""
    extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run this device's float32 decode products over reordered weights."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ([out, in], float32) reordered into oneDNN's blocked layout for ``rows``-row products
    (an opaque mkldnn tensor; the op inductor's CPU weight freezing uses)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A decode product over a weight packed by :func:`_pack` (oneDNN's float32 inner product) or
    over a plain ``[out, in]`` weight (:func:`_split_linear`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return _split_linear(x, weight, bias)


def _prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A prefill product (many rows): over a packed weight as in decode, else the plain F.linear."""
    return _linear(x, weight, bias) if weight.is_mkldnn else F.linear(x, weight, bias)


def _split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a decode step's few rows: the weight's output rows split
    into one block per torch thread, multiplied as one batched product (each dot product is still
    one row of ``weight`` against one row of ``x``).

    Why: at one row the product is a matrix-vector product, which MKL runs on one thread,
    streaming the weights at ~10-15 GB/s on this 2-core CPU; the batched product runs one block
    per thread and streams 17-22 GB/s (SmolLM2's shapes). At 2-16 rows the plain product is
    multi-threaded but packs the weight each call; the batched one is faster there too. A
    SmolLM2-135M decode step, plain vs split (medians of 3 x 5 steps, interleaved): 63 vs 40 ms
    at 1 row, 110 vs 66 at 2, 89 vs 54 at 4, 106 vs 75 at 8, 109 vs 83 at 16."""
    parts = torch.get_num_threads()
    out, inner = weight.shape
    if parts < 2 or out % parts or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    y = torch.bmm(x.expand(parts, rows, inner), weight.view(parts, out // parts, inner).transpose(1, 2))
    y = y.transpose(0, 1).reshape(rows, out)
    return y if bias is None else y + bias


def _split_inner(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` for ``weight_t`` stored ``[in, out]``: the input dimension split
    into one block per torch thread, the blocks' products batched, their partial sums added
    (so each output sums its terms in two halves: float32 rounding differs from F.linear's)."""
    parts = torch.get_num_threads()
    inner, out = weight_t.shape
    if parts < 2 or inner % parts:
        y = x @ weight_t
    else:
        rows = x.shape[0]
        y = torch.bmm(x.reshape(rows, parts, inner // parts).transpose(0, 1),
                      weight_t.view(parts, inner // parts, out)).sum(0)
    return y if bias is None else y + bias


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm module's formula as one fused op (same values in float32)."""
    if x.dtype != torch.float32:
        return norm(x)  # HF computes in float32 and casts back; keep its rounding
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _qk_norm(attn: torch.nn.Module, qkv: torch.Tensor, heads: int, qk_heads: int) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of the query heads (``q_norm``) and key heads (``k_norm``) of a
    fused ``[rows, heads + 2 * kv_heads, head_dim]`` projection: ``[rows, heads + kv_heads, head_dim]``."""
    return torch.cat((_rms_norm(attn.q_norm, qkv[:, :heads]), _rms_norm(attn.k_norm, qkv[:, heads:qk_heads])), dim=1)


def _fuse_rows(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One contiguous ``[sum(out), in]`` matrix (and bias) whose row blocks become the linears' parameters."""
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
             for b, lin in zip(biases, linears)])
        start = 0
        for lin in linears:
            n = lin.out_features
            lin.weight.data = weight[start:start + n]
            if lin.bias is not None:
                lin.bias.data = bias[start:start + n]
            start += n
    return weight, bias
