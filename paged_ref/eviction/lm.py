"""A Llama-family model decoding many sequences from one `PagedKVCache`, each under its own policy.

The eviction evaluation compares a dozen policies on the same text. Their prompts are the same,
and prefill attends to the whole prompt whatever the policy (eviction happens after prefill),
so the prompt's K/V are computed once, by the model's own forward (`prompt_kv`), and copied
into one cache sequence per policy (`add_prompt`). Then `decode_step` advances every sequence
by one token in one batched forward: the linear layers see ``[batch, 1, hidden]``; attention
gathers each sequence's pages (sequences of equal length together) and runs
``scaled_dot_product_attention``; `extend` feeds several tokens per sequence at once (causal
over the pages), which a policy allows between its actions (`tokens_until_action`). RoPE uses
each sequence's absolute position, which the caller keeps (eviction shrinks what a sequence
holds, never where its next token sits).

This is the model's computation re-stated layer by layer (embedding, RMSNorm, q/k/v
projections, rotary embedding, attention, o_proj, MLP, final norm, head) with transformers'
own modules; `tests/test_eviction.py` checks it against the model's forward.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> from paged_ref.eviction.policies import FullCache
    >>> lm = PagedLM(tiny_llama())
    >>> cache = lm.new_cache(num_pages=8, page_size=4)
    >>> prompt = torch.tensor([1, 5, 9, 11, 3])
    >>> logits, ks, vs = lm.prompt_kv(prompt)             # logits [5, vocab]; ks[layer]: [5, Hkv, D]
    >>> policy = FullCache()
    >>> s = lm.add_prompt(cache, ks, vs, policy)
    >>> nxt = lm.decode_step(cache, [s], torch.tensor([7]), torch.tensor([5]))   # [1, vocab]
    >>> policy.after_append(cache, s); cache.seq_len(s)
    6
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from ..cache import PagedKVCache
from ..layered_cache import LayeredKVCache
from ..memory import model_geometry
from .policies import EvictionPolicy

__all__ = ["PagedLM"]


class PagedLM:
    """Decode over a `PagedKVCache` with a transformers Llama-family model's weights.

    Args:
        model: a ``LlamaForCausalLM``-like model (``model.model.layers[i].self_attn.{q,k,v,o}_proj``,
            ``input_layernorm``, ``post_attention_layernorm``, ``mlp``; ``model.model.rotary_emb``).
    """

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            raise TypeError(
                f"model must be a Llama-family causal LM (model.model.layers, rotary_emb), got {type(model).__name__}"
            )

        self.model = model
        self.geometry = model_geometry(model)
        self.num_layers = self.geometry.num_layers
        self.num_q_heads = self.geometry.num_q_heads
        self.num_kv_heads = self.geometry.num_kv_heads
        self.head_dim = self.geometry.head_dim
        self.dtype = self.geometry.dtype
        self._rope = apply_rotary_pos_emb

    def new_cache(self, *, num_pages: int, page_size: int, per_layer: bool = False) -> PagedKVCache | LayeredKVCache:
        """An empty cache shaped for this model (float32 K/V, like the model's activations here).

        ``per_layer=True``: a `LayeredKVCache` (a block table per layer, for per-layer eviction
        decisions) of the same memory.
        """
        cls = LayeredKVCache if per_layer else PagedKVCache
        return cls(num_pages=num_pages, page_size=page_size, **self.geometry.cache_kwargs)

    @torch.inference_mode()
    def prompt_kv(self, ids: torch.Tensor):
        """The model's own forward over ``ids: LongTensor [n]``.

        Returns:
            ``(logits [n, vocab] float32, ks, vs)`` with ``ks[layer], vs[layer]: [n, Hkv, D]``, the
            K (after RoPE) and V the model caches for each token. K/V of token ``i`` depend only on
            tokens ``<= i``, so the first ``m`` rows are also the K/V of the prefix ``ids[:m]``.
        """
        out = self.model(ids.view(1, -1), use_cache=True)
        layers = out.past_key_values.layers
        ks = [layer.keys[0].transpose(0, 1).contiguous() for layer in layers]  # each [n, Hkv, D]
        vs = [layer.values[0].transpose(0, 1).contiguous() for layer in layers]  # each [n, Hkv, D]
        return out.logits[0].float(), ks, vs

    def add_prompt(self, cache: PagedKVCache, ks, vs, policy: EvictionPolicy | None) -> int:
        """A new sequence holding a prompt's K/V (``ks[layer]: [n, Hkv, D]``), then ``policy.after_prefill``."""
        n = ks[0].shape[0]
        seq_id = cache.add_sequence()
        slots = cache.reserve(seq_id, n)  # int64 [n], or [num_layers, n] with a table per layer
        for layer in range(self.num_layers):
            cache.write(layer, slots[layer] if slots.dim() == 2 else slots, ks[layer], vs[layer])
        if policy is not None:
            policy.after_prefill(cache, seq_id)
        return seq_id

    @torch.inference_mode()
    def decode_step(
        self, cache: PagedKVCache, seq_ids: list[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Append one token to each sequence and return the next-token logits.

        Args:
            cache: the cache holding ``seq_ids``.
            seq_ids: ``batch`` distinct live sequences.
            token_ids: LongTensor ``[batch]``, the token each sequence takes next.
            positions: LongTensor ``[batch]``, its absolute position (for RoPE).

        Returns:
            float32 ``[batch, vocab]``. The caller then runs each sequence's ``after_append`` hook.
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must have shape [batch], got {list(token_ids.shape)}")
        return self.extend(cache, seq_ids, token_ids[:, None], positions)[:, 0]

    @torch.inference_mode()
    def extend(
        self, cache: PagedKVCache, seq_ids: list[int], token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Append ``m`` tokens to each sequence (teacher forcing) and return the logits after each.

        New token ``i`` of a sequence attends to everything the sequence holds before it plus the
        new tokens up to itself (causal), exactly what ``m`` decode steps in a row would compute
        if no eviction happens in between (feed at most ``policy.tokens_until_action`` tokens).

        Args:
            cache: the cache holding ``seq_ids``.
            seq_ids: ``batch`` distinct live sequences.
            token_ids: LongTensor ``[batch, m]``, the tokens each sequence takes next.
            positions: LongTensor ``[batch]``, absolute position of each row's first new token.

        Returns:
            float32 ``[batch, m, vocab]``.
        """
        batch = len(seq_ids)
        if token_ids.dim() != 2 or token_ids.shape[0] != batch or positions.shape != (batch,):
            raise ValueError(
                f"token_ids must have shape [{batch}, m] and positions [{batch}], got "
                f"{list(token_ids.shape)} and {list(positions.shape)}"
            )
        m = token_ids.shape[1]
        # int64 [batch * m] (rows in order), or [num_layers, batch * m] with a block table per layer
        slots = torch.cat([cache.reserve(s, m) for s in seq_ids], dim=-1)
        if slots.dim() == 2:
            tables = [cache.block_table(seq_ids, layer=i) for i in range(self.num_layers)]
        else:
            tables = [cache.block_table(seq_ids)] * self.num_layers  # int32 [batch, max_pages], [batch]
        inner = self.model.model
        x = inner.embed_tokens(token_ids)  # [batch, m, hidden]
        pos = positions[:, None] + torch.arange(m)[None, :]  # [batch, m]
        cos, sin = inner.rotary_emb(x, pos)  # each [batch, m, D]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)  # [batch, m, hidden]
            q = attn.q_proj(h).view(batch, m, hq, d).transpose(1, 2)  # [batch, Hq, m, D]
            k = attn.k_proj(h).view(batch, m, hkv, d).transpose(1, 2)  # [batch, Hkv, m, D]
            v = attn.v_proj(h).view(batch, m, hkv, d)  # [batch, m, Hkv, D]
            q, k = self._rope(q, k, cos, sin)
            layer_slots = slots[i] if slots.dim() == 2 else slots
            cache.write(i, layer_slots, k.transpose(1, 2).reshape(batch * m, hkv, d), v.reshape(batch * m, hkv, d))
            o = self._attend(q, cache, i, *tables[i], attn.scaling)  # [batch, Hq, m, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, m, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x)).float()  # [batch, m, vocab]

    @staticmethod
    def _attend(q, cache, layer, block_table, seq_lens, scale):
        """Causal attention of the new tokens over each sequence's pages.

        Sequences holding the same number of tokens (all sequences of one budget and page size
        do) are gathered together, ``[group, Hkv, n, D]``, and go through one
        ``scaled_dot_product_attention`` call with grouped-query heads; no padding is needed.

        q: ``[batch, Hq, m, D]``; the new tokens are the last ``m`` of each sequence.
        """
        m, ps = q.shape[2], cache.page_size
        out = torch.empty_like(q)  # [batch, Hq, m, D]
        groups: dict[int, list[int]] = {}
        for b, n in enumerate(seq_lens.tolist()):
            groups.setdefault(n, []).append(b)
        for n, rows in groups.items():
            idx = torch.tensor(rows)
            pages = block_table[idx, : cdiv(n, ps)].long()  # [g, pages]
            k = cache.k_cache[layer][pages].flatten(1, 2)[:, :n].transpose(1, 2)  # [g, Hkv, n, D]
            v = cache.v_cache[layer][pages].flatten(1, 2)[:, :n].transpose(1, 2)  # [g, Hkv, n, D]
            mask = None
            if m > 1:  # new token i sits at n - m + i and sees tokens 0 .. n - m + i
                mask = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]  # bool [m, n]
            out[idx] = torch.nn.functional.scaled_dot_product_attention(
                q[idx], k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out
