"""PagedSession: a transformers causal LM run over sequences whose K/V live in pages.

The session is the engine under `generate`, beam search and the serving engine. It owns (or
borrows) a `PagedKVCache`, keeps each sequence's *absolute position* (its next RoPE position) and
runs forwards with `extend`: any number of new tokens for any subset of its sequences, one forward
for all of them. ``position(seq)`` counts every token the sequence was fed, ``kv.seq_len(seq)`` the
tokens still held: once an eviction policy drops tokens they differ, and RoPE must still use the
absolute position (the kept keys were rotated with theirs), so the session passes ``position_ids``.

Eviction hooks: each sequence may have a policy (`paged_ref.eviction`, the session's or its own);
after each forward that feeds it, the session calls ``policy.after_prefill(kv, seq)`` (its first)
or ``policy.after_append(kv, seq)``, feeding at most ``policy.tokens_until_action`` tokens between
calls. On a `LayeredKVCache` each layer attends through its own block table (per-layer eviction).

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> with PagedSession(model, num_pages=8, page_size=4) as session:
    ...     s = session.add()
    ...     logits = session.extend([s], [torch.tensor([1, 5, 7])])   # prefill: [1, vocab]
    ...     logits = session.extend([s], [logits.argmax(-1)])         # decode one token
    ...     session.kv.seq_len(s), session.position(s)
    (4, 4)
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import time
from dataclasses import replace

import torch

from .._cache_checks import check_reserved
from .._validate import check_bool
from ..cache_interface import KVCache
from ..eviction.base import check_policy
from ..eviction.policies import EvictionPolicy
from ..memory import model_geometry
from ._checks import check_batch, check_live, check_room, for_8bit_pages, session_cache, token_ids
from .attention import ATTN_IMPLEMENTATION, AUTO, get_backend, paged_attention_active, register, set_attn_implementation
from .cache import PagedCache, StepPlan, pack_rows

__all__ = ["PagedSession", "cache_keyword", "fast_step"]


def logits_to_keep(plan: StepPlan, q_lens: list[int], all_logits: bool):
    """The columns the model computes logits for: each row's last new token (0: every column)."""
    if all_logits:
        return 0
    if plan.parts is not None:  # one packed row
        return torch.tensor(list(itertools.accumulate(q_lens)), device=plan.kv.device) - 1  # [batch]
    if plan.is_decode:
        return 1
    return torch.tensor(sorted({n - 1 for n in q_lens}), device=plan.kv.device)


def cache_keyword(model) -> str:
    """Name of the forward argument taking the cache: ``cache`` (5.24) or ``past_key_values`` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def fast_step(fast, model, *, rows: int | None = None):
    """``fast=`` as a step runs it: None (the eager step) for None, False or ``Fast()``, else a
    `paged_ref.fast.Fast` (True: every part ``model`` allows; ``few_rows=True``: ``rows`` when given).
    The lesson's one door to `paged_ref.fast`: the speed-ups stay outside the story."""
    if fast is None or fast is False:
        return None
    from ..fast import resolve

    return resolve(fast, model, rows=rows)


class PagedSession:
    """Sequences of one model sharing one paged KV cache; see the module docstring.

    Args:
        model: a transformers causal LM whose attention goes through `AttentionInterface`
            (Llama, Mistral, Qwen2, SmolLM2, ...), in eval mode.
        kv_cache: a `KVCache` matching the model, or None to create a `PagedKVCache` of ``num_pages``
            pages of ``page_size`` tokens.
        backend: a name of `paged_ref.hf.attention.BACKENDS`, ``"auto"`` (the default) or a `Backend`.
        eviction: the policy of every sequence not given its own, an `paged_ref.eviction.EvictionPolicy`
            (``make_policy("paged_eviction", 256)``: a budget of 256 tokens), or None.
        fast: the CPU speed-ups, beside the lesson (`paged_ref.fast.Fast`; True: all the model allows;
            None, the default: the eager step); the same tokens (`fast_step`).
        kv_format: with ``num_pages``, the new cache's 8-bit pages (`paged_ref.quant.KVFormat`); None: floating.

    The model's attention is ``"paged_ref"`` only during each `extend` forward: several sessions can
    share one model, and ``model.generate`` works beside them. `close` frees every sequence.
    """

    def __init__(
        self,
        model,
        *,
        kv_cache: KVCache | None = None,
        num_pages: int | None = None,
        page_size: int = 16,
        backend=AUTO,
        eviction=None,
        fast=None,
        kv_format=None,
    ):
        fast = fast_step(fast, model)
        if fast is not None and fast.backend is not None:
            if backend != AUTO and backend != fast.backend:
                raise ValueError(f"backend={backend!r} and fast.backend={fast.backend!r}: name the backend once")
            backend = fast.backend
        eviction = check_policy(eviction, None)
        geometry = model_geometry(model)
        self._backend = get_backend(backend, geometry.device, "fast.backend" if fast and fast.backend else "backend")
        kv_cache = session_cache(geometry, kv_cache, num_pages=num_pages, page_size=page_size, kv_format=kv_format)
        if kv_cache.kv_scales(0)[0] is not None:  # 8-bit pages: a backend that reads them
            self._backend = for_8bit_pages(self._backend, asked=backend)
        self.model, self.kv = model, kv_cache
        self.backend = self._backend.name
        self.eviction = eviction  # the default policy (it carries its own budget)
        self._decode, self._prefill = self._backend.functions()
        self._packed = self._backend.packed_function()
        self._hf_cache = PagedCache(kv_cache)
        self._linears, self._flat = fast.contexts(model) if fast else (contextlib.nullcontext(),) * 2
        self._cache_kw = cache_keyword(model)
        self._positions: dict[int, int] = {}  # seq_id -> next absolute position
        self._policies: dict[int, EvictionPolicy | None] = {}  # seq_id -> its eviction policy
        self._held: dict[int, int] = {}  # seq_id -> tokens held after its last forward and policy (past its prefill)
        self._open = False
        self._closed = False  # close() freed every sequence; add() waits for open() again
        self.plan_seconds = 0.0  # host time spent laying out forwards (slots, tables, attention inputs)

    # ------------------------------------------------------------------ lifetime
    def open(self) -> PagedSession:
        """Register the paged attention and check that the model accepts it (done by ``with``)."""
        if not self._open:
            register()
            previous = self.model.config._attn_implementation
            try:  # the full switch once: raises TypeError if the model refuses the implementation
                set_attn_implementation(self.model, ATTN_IMPLEMENTATION)
            finally:
                set_attn_implementation(self.model, previous)
            self._open, self._closed = True, False
        return self

    def close(self) -> None:
        """Free every sequence still held; `add` is refused until the session is opened again."""
        self._open, self._closed = False, True
        for seq_id in list(self._positions):
            self.finish(seq_id)

    def __enter__(self) -> PagedSession:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ sequences
    def add(self, token_ids=None, *, eviction: EvictionPolicy | None = None, namespace: dict | None = None) -> int:
        """Start a sequence under policy ``eviction`` (default: the session's); returns its id in `kv`.

        With ``token_ids`` (the prompt) on a cache with ``prefix_caching=True``, the full pages of it
        the cache holds are reused: the caller then feeds ``token_ids[position(seq_id):]`` (at least
        the last token). Pages are shared only within one ``namespace`` (`PagedKVCache.add_sequence`).

        Example:
            >>> from paged_ref import PagedKVCache
            >>> from paged_ref.models import tiny_llama
            >>> model = tiny_llama()
            >>> kv = PagedKVCache.for_model(model, num_pages=8, page_size=4, prefix_caching=True)
            >>> prompt = list(range(5, 15))                                  # 10 tokens
            >>> with PagedSession(model, kv_cache=kv) as session:
            ...     a = session.add(prompt); _ = session.extend([a], [torch.tensor(prompt)])
            ...     b = session.add(prompt + [3])                             # same prompt, one more token
            ...     session.position(b)                                       # two full pages reused
            8
        """
        if self._closed:
            raise RuntimeError(
                "PagedSession.add on a closed session: open it again (`with session:`) or make a new one"
            )
        policy = check_policy(eviction, self.eviction, self.kv)
        seq_id = self.kv.add_sequence(token_ids=token_ids, namespace=namespace)
        self._positions[seq_id] = self.kv.seq_len(seq_id)  # RoPE continues after reused tokens
        self._policies[seq_id] = policy
        return seq_id

    def fork(self, seq_id: int, *, eviction: EvictionPolicy | None = None) -> int:
        """A new sequence holding ``seq_id``'s tokens (its pages shared, copy-on-write) at its position.

        The fork's tokens are its prompt: its policy (default: the session's) runs ``after_prefill``
        now, so one prefilled prompt serves sequences under different policies."""
        check_live(seq_id, self._positions)
        policy = check_policy(eviction, self.eviction, self.kv)
        new = self.kv.fork(seq_id)
        self._positions[new] = self._positions[seq_id]
        self._policies[new] = policy
        try:
            self._after_forward(new, phase_prefill=True)
        except BaseException:
            self.finish(new)
            raise
        return new

    def finish(self, seq_id: int) -> None:
        """Free the sequence's pages (they go back to the allocator at once)."""
        check_live(seq_id, self._positions)
        del self._positions[seq_id]
        self._held.pop(seq_id, None)
        policy = self._policies.pop(seq_id)
        self.kv.free(seq_id)
        if policy is not None:
            policy.release(seq_id)

    def position(self, seq_id: int) -> int:
        """Absolute position the sequence's next token will take (tokens fed so far)."""
        check_live(seq_id, self._positions)
        return self._positions[seq_id]

    @property
    def seq_ids(self) -> list[int]:
        return list(self._positions)

    # ------------------------------------------------------------------ the forward
    @torch.inference_mode()
    def extend(
        self,
        seq_ids: list[int],
        tokens: list[torch.Tensor],
        *,
        all_logits: bool = False,
        packed: bool = False,
        reserved: bool = False,
    ):
        """Feed new tokens to some sequences in one forward and return their logits.

        Args:
            seq_ids: the sequences (distinct, live), one per batch row.
            tokens: for each, a LongTensor ``[n_b]`` (n_b >= 1) of new token ids.
            all_logits: return every new token's logits, not only the last one's.
            packed: rows of different lengths (a prompt chunk beside decodes) go to the model as one
                row of all the new tokens, not a padded ``[batch, max_n_b]`` rectangle (`pack_rows`):
                the same logits, no padding computed. Not on a `LayeredKVCache`.
            reserved: a scheduler reserved each row's tokens, and no more, since the sequence's last forward
                (`PagedKVCache.reserve`); the forward writes into them, and undoing them is the caller's.

        Returns float32 ``[batch, vocab]``, the logits after each row's last new token (with
        ``all_logits``, a list of ``[n_b, vocab]``). Up to the forward's end it is all or nothing: bad
        arguments, a pool short of pages or a forward that raises leave every sequence as it was. Then
        each sequence's policy runs; one that raises changes nothing, its error raised after the others ran.
        """
        for name, flag in dict(all_logits=all_logits, packed=packed, reserved=reserved).items():
            check_bool(name, flag)
        seq_ids, tokens, q_lens = self._checked(seq_ids, tokens, reserved)  # 1. check, before any page moves
        out, plan = self._forward(seq_ids, tokens, q_lens, all_logits=all_logits, packed=packed, reserved=reserved)
        self._fed(seq_ids, q_lens)  # 3. positions move on, the policies act
        return self._logits(out.logits.float(), plan, q_lens, all_logits)  # 4. [batch, vocab], or a list

    def _checked(self, seq_ids, tokens, reserved: bool) -> tuple[list[int], list[torch.Tensor], list[int]]:
        """`extend`'s arguments checked: live distinct sequences, tokens as LongTensors ``[n_b]`` (n_b >= 1) on
        the cache's device, each row within what its policy may be fed before it acts."""
        if not self._open:
            raise RuntimeError("PagedSession.extend needs an open session: use `with PagedSession(...) as s:`")
        seq_ids, tokens = check_batch(seq_ids, tokens, self._positions)
        device, vocab = self.kv.device, self.model.config.vocab_size
        tokens = [token_ids(f"tokens[{b}]", t, vocab).to(device) for b, t in enumerate(tokens)]
        q_lens = [t.numel() for t in tokens]
        if min(q_lens) < 1:
            raise ValueError(f"each tokens[b] must hold at least one token, got lengths {q_lens}")
        if reserved:  # exactly each row's tokens reserved since its last forward (before it: since `add`)
            check_reserved(seq_ids, q_lens, {s: self._held.get(s, self._positions[s]) for s in seq_ids}, self.kv)
        else:  # a scheduler's rows end where the policy acts
            check_room(seq_ids, q_lens, {s: self._policies[s] for s in seq_ids if s in self._held}, self.kv)
        return seq_ids, tokens, q_lens

    def _forward(self, seq_ids, tokens, q_lens, *, all_logits: bool, packed: bool, reserved: bool):
        """2. The model's forward over the rows, all or nothing: if the reservation or the forward raises,
        every sequence goes back to its mark (`PagedKVCache.rewind`). Returns the output and the `StepPlan`."""
        marks = [self.kv.mark(s) for s in seq_ids]
        started = time.perf_counter()
        try:
            plan, input_ids, position_ids = self._plan(seq_ids, tokens, q_lens, packed=packed, reserved=reserved)
            self.plan_seconds += time.perf_counter() - started
            keep = logits_to_keep(plan, q_lens, all_logits)
            self._hf_cache.plan = plan
            with paged_attention_active(self.model), self._linears, self._flat:
                out = self.model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    use_cache=True,
                    logits_to_keep=keep,
                    paged_step=plan,  # reaches paged_attention_forward through **kwargs
                    **{self._cache_kw: self._hf_cache},
                )
        except BaseException:
            for s, mark in reversed(list(zip(seq_ids, marks))):  # the last first
                self.kv.rewind(s, mark)
            raise
        finally:
            self._hf_cache.plan = None
        return out, plan

    def _fed(self, seq_ids, q_lens) -> None:
        """3. Positions move on, then each sequence's policy runs (the first error raised after the others ran)."""
        prefill = [s not in self._held for s in seq_ids]
        for s, n in zip(seq_ids, q_lens):
            self._positions[s] += n
        error = None
        for s, first in zip(seq_ids, prefill):
            try:
                self._after_forward(s, phase_prefill=first)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error

    def _logits(self, logits, plan, q_lens, all_logits: bool):
        """Each row's logits out of the kept columns, ``logits: [batch, kept, vocab]`` (``[1, kept, vocab]`` packed)."""
        if all_logits:  # the valid tokens, row after row
            return list((logits.flatten(0, 1) if plan.valid is None else logits[plan.valid]).split(q_lens))
        if plan.parts is not None or plan.is_decode:
            return logits[0] if plan.parts is not None else logits[:, -1]  # [batch, vocab]
        device, columns = self.kv.device, sorted({n - 1 for n in q_lens})
        pick = torch.tensor([columns.index(n - 1) for n in q_lens], device=device)  # each row's kept column
        return logits[torch.arange(len(q_lens), device=device), pick]  # [batch, vocab]

    def _plan(self, seq_ids, tokens, q_lens_list, packed=False, reserved=False):
        """Reserve cache slots for the new tokens and lay them out as a ``[batch, max_q_len]`` rectangle
        (or, ``packed`` and of different lengths, as one row: `pack_rows`)."""
        device = self.kv.device
        batch, max_q = len(seq_ids), max(q_lens_list)
        if reserved:
            slots = [self.kv.last_slots(s, n) for s, n in zip(seq_ids, q_lens_list)]  # each [n]
        else:
            token_ids = [t.tolist() for t in tokens] if self.kv.prefix_caching else None  # full pages findable
            slots = self.kv.reserve_batch(seq_ids, q_lens_list, token_ids)  # each [n] or [layers, n]; all or nothing
        q_lens = torch.tensor(q_lens_list, dtype=torch.int32, device=device)  # [batch]
        start = torch.tensor([self._positions[s] for s in seq_ids], device=device)  # [batch]
        col = torch.arange(max_q, device=device)  # [max_q]
        # padding columns repeat the row's last position (keeps max(position) honest for dynamic RoPE)
        position_ids = start[:, None] + torch.minimum(col[None, :], (q_lens - 1)[:, None].long())  # [batch, max_q]
        if all(n == max_q for n in q_lens_list):
            valid = None
            input_ids = torch.stack(tokens)  # [batch, max_q]
        else:
            valid = col[None, :] < q_lens[:, None]  # [batch, max_q]
            input_ids = torch.zeros(batch, max_q, dtype=torch.long, device=device)
            input_ids[valid] = torch.cat(tokens)
        block_table, seq_lens = self.kv.block_table(seq_ids)  # int32 [batch, max_pages], [batch]
        plan = StepPlan(
            kv=self.kv,
            seq_ids=list(seq_ids),
            slots=torch.cat(slots, dim=-1),  # [num_new], or [num_layers, num_new]
            q_lens=q_lens,
            valid=valid,
            block_table=block_table,
            seq_lens=seq_lens,
            decode=self._decode,
            prefill=self._prefill,
            max_q_len=max_q,
            packed=self._packed,
            span=max(self._positions[s] + n for s, n in zip(seq_ids, q_lens_list)),
        )
        if packed and valid is not None and not self.kv.tables_per_layer:
            return (plan, *pack_rows(plan, input_ids, position_ids, self._backend.prepare))
        plan.attn_kwargs = self._backend.prepare(plan)
        if self.kv.tables_per_layer:  # a block table per layer, each prepared once
            tables = [self.kv.block_table(seq_ids, layer=i)[0] for i in range(1, self.kv.num_layers)]
            plan.layer_tables = [(block_table, plan.attn_kwargs)] + [
                (bt, self._backend.prepare(replace(plan, block_table=bt))) for bt in tables
            ]
        return plan, input_ids, position_ids

    def _after_forward(self, seq_id: int, *, phase_prefill: bool) -> None:
        """The eviction hooks: let the sequence's policy shrink its cache (see the module docstring)."""
        policy = self._policies[seq_id]
        self._held[seq_id] = self.kv.seq_len(seq_id)  # a policy that raises changes nothing
        if policy is not None:
            (policy.after_prefill if phase_prefill else policy.after_append)(self.kv, seq_id)
            self._held[seq_id] = self.kv.seq_len(seq_id)
