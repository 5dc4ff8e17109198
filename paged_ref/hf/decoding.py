"""How tokens are chosen, as transformers' ``generate`` chooses them.

`generate`, `stream` and `beam_search` take ``model.generate``'s decoding arguments with its names,
defaults and precedence: an argument passed wins, then the model's ``generation_config``, then
transformers' defaults (`DEFAULTS`). `resolve` checks them before a page is taken, as transformers
does (plus ``top_p`` outside (0, 1]), and refuses by name a ``generation_config`` asking for a logits
processor paged_ref does not implement (``repetition_penalty``, ``min_p``, ...).

``num_beams > 1`` is beam search (`paged_ref.hf.beam_selection`); else `choose` takes the argmax,
or with ``do_sample`` passes the logits through transformers' warpers in its order (``temperature``,
``top_k``, ``top_p``, computed as it computes them, so that a token on a boundary falls on the same
side) and draws one token per row. After the same ``torch.manual_seed`` the draws are
``model.generate``'s: one ``torch.multinomial`` per step over *every* row, finished rows included
with a placeholder distribution (the one-sample ``multinomial`` draws ``argmax(p / q)``, ``q ~
Exp(1)`` over the whole ``[rows, vocab]`` tensor, so the placeholder changes no other row's token).

Example:
    >>> import dataclasses, torch
    >>> from paged_ref.models import tiny_llama
    >>> d = resolve(tiny_llama(), do_sample=True, top_k=2)
    >>> d.mode, d.top_k, d.top_p
    ('sample', 2, 1.0)
    >>> warp(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), d)        # top_k=2 keeps the two largest
    tensor([[-inf, 3., -inf, 2.]])
    >>> torch.manual_seed(0) and None
    >>> choose(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), d)                 # drawn from tokens 1 and 3 only
    tensor([1])
    >>> choose(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), dataclasses.replace(d, do_sample=False))  # greedy
    tensor([1])
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .._validate import check_bool, check_int, check_real

__all__ = ["DEFAULTS", "Decoding", "choose", "resolve", "top_k_warp", "top_p_warp", "warp"]

# transformers' global defaults (`GenerationConfig._get_default_generation_params`) for these names
DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "num_return_sequences": 1,
    "num_beams": 1,
    "length_penalty": 1.0,
    "early_stopping": False,
}

# generation_config settings that would add a logits processor paged_ref does not implement,
# each with the values that leave the logits alone (transformers' own tests for "off")
_OFF = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),  # a decoder's prompt is its "encoder input"
    "encoder_no_repeat_ngram_size": (None, 0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
    "guidance_scale": (None, 1.0),
    "exponential_decay_length_penalty": (None,),
    "remove_invalid_values": (None, False),
    "renormalize_logits": (None, False),
    "watermarking_config": (None,),
    "num_beam_groups": (None, 1),
    "low_memory": (None, False),
    "max_time": (None,),  # stopping criteria paged_ref.hf does not implement either
    "stop_strings": (None,),
    "token_healing": (None, False),
}
_OFF_WHEN_SAMPLING = {  # warpers transformers applies only with do_sample
    "min_p": (None,),
    "top_h": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
}


@dataclass(frozen=True)
class Decoding:
    """The resolved decoding arguments, named as in transformers' `GenerationConfig`.

    ``top_k=0`` and ``top_p=1.0`` set no limit; ``num_return_sequences`` are independent samples
    sharing the prompt's pages, or the best of the ``num_beams`` finished beams. A finished beam
    scores its summed log-probability over ``generated_length ** length_penalty``; ``early_stopping``:
    ``True`` stops once ``num_beams`` beams finished, ``False`` when no running beam can beat the
    finished ones at the current length, ``"never"`` when none can at any length.
    """

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    num_return_sequences: int
    num_beams: int
    length_penalty: float
    early_stopping: bool | str

    @property
    def mode(self) -> str:
        """``"greedy"``, ``"sample"`` or ``"beam"``."""
        if self.num_beams > 1:
            return "beam"
        return "sample" if self.do_sample else "greedy"


def resolve(model, **given) -> Decoding:
    """The decoding arguments for ``model``: ``given`` (None = not given) over the model's
    ``generation_config`` over `DEFAULTS`, checked (NotImplementedError: beam sampling, or a logits
    processor paged_ref does not implement)."""
    config = getattr(model, "generation_config", None)
    values = {}
    for name, default in DEFAULTS.items():
        value = given.get(name)
        if value is None:
            value = getattr(config, name, None)
        values[name] = default if value is None else value

    do_sample = check_bool("do_sample", values["do_sample"])
    num_beams = check_int("num_beams", values["num_beams"], min_value=1)
    n = check_int("num_return_sequences", values["num_return_sequences"], min_value=1)
    temperature = check_real("temperature", values["temperature"])
    top_p = check_real("top_p", values["top_p"])
    top_k = check_int("top_k", values["top_k"])
    length_penalty = check_real("length_penalty", values["length_penalty"])
    early_stopping = values["early_stopping"]
    number = isinstance(early_stopping, numbers.Number) and not isinstance(early_stopping, bool)
    if early_stopping not in (True, False, "never") or number:  # a number: 1 == True and 0.0 == False
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")

    if do_sample:  # the warpers' own checks (transformers makes them only when it samples)
        if not temperature > 0:
            hint = "; for greedy decoding pass do_sample=False" if temperature == 0 else ""
            raise ValueError(f"temperature must be > 0 when sampling (do_sample=True), got {temperature}{hint}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 when sampling (0: no top-k limit), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] when sampling (1: no top-p limit), got {top_p}")
    if num_beams == 1 and not do_sample and n > 1:
        raise ValueError(
            f"greedy decoding (do_sample=False, num_beams=1) gives one sequence per prompt: num_return_sequences "
            f"must be 1, got {n}; pass do_sample=True for {n} samples or num_beams>={n} for {n} beams"
        )
    if num_beams > 1 and n > num_beams:
        raise ValueError(
            "num_return_sequences must be <= num_beams (the beams are the candidates returned), "
            f"got num_return_sequences={n} with num_beams={num_beams}"
        )
    if num_beams > 1 and do_sample:
        raise NotImplementedError(
            f"beam sampling (num_beams={num_beams} with do_sample=True) is not implemented in paged_ref.hf; "
            "use do_sample=False for beam search or num_beams=1 for sampling"
        )
    _check_processors(config, do_sample)
    return Decoding(do_sample, temperature, top_k, top_p, n, num_beams, length_penalty, early_stopping)


def _check_processors(config, do_sample: bool) -> None:
    """Refuse a generation_config that turns on a logits processor not implemented here (None: none)."""
    for name, off in {**_OFF, **(_OFF_WHEN_SAMPLING if do_sample else {})}.items():
        value = getattr(config, name, None)
        if not any(value is v or (v is not None and value == v) for v in off):
            raise NotImplementedError(
                f"the model's generation_config sets {name}={value!r}, a logits processor or stopping criterion "
                f"paged_ref.hf does not implement; generate on a model whose generation_config leaves it at {off[-1]!r}"
            )


def top_k_warp(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest scores (and any equal to the k-th); the rest become -inf."""
    kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]  # [rows, 1]: the k-th largest score
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_warp(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens holding at least ``top_p`` of the probability."""
    ascending, order = torch.sort(scores, descending=False)  # [rows, vocab], least likely first
    below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and all less likely ones
    drop_sorted = below <= (1 - top_p)  # these together hold at most 1 - top_p: the tail to cut
    drop_sorted[..., -1:] = False  # the most likely token always stays
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
    return scores.masked_fill(drop, float("-inf"))


def warp(logits: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """The sampling warpers transformers applies for ``decoding``, in its order; ``[rows, vocab]``."""
    scores = logits if decoding.temperature == 1.0 else logits / decoding.temperature
    if decoding.top_k != 0:
        scores = top_k_warp(scores, decoding.top_k)
    if decoding.top_p < 1.0:
        scores = top_p_warp(scores, decoding.top_p)
    return scores


def choose(
    logits: torch.Tensor, decoding: Decoding, *, rows: int | None = None, active: list[int] | None = None
) -> torch.Tensor:
    """The next token of each row still generating, LongTensor ``[len(active)]``, from its logits,
    float32 ``[len(active), vocab]``. The batch has ``rows`` rows (default: all active); a sampled
    draw is made over all of them, the finished ones with a placeholder distribution."""
    if not decoding.do_sample:
        return logits.argmax(dim=-1)
    probs = warp(logits, decoding).softmax(dim=-1)  # [num_active, vocab]
    if rows is None or active is None or len(active) == rows:
        return torch.multinomial(probs, num_samples=1)[:, 0]
    full = torch.ones(rows, probs.shape[-1], dtype=probs.dtype, device=probs.device)  # [rows, vocab]
    index = torch.tensor(active, device=probs.device)
    full[index] = probs
    return torch.multinomial(full, num_samples=1)[index, 0]
