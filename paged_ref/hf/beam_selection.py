"""transformers' beam selection, tensor for tensor: what `paged_ref.hf.beam` runs the pages after.

Each step the ``2k`` best (beam, token) candidates by summed log-probability are ranked (more with
several EOS ids); the ``k`` best that do not end run on, and one among the ``k`` best that ends (EOS
or the length limit), scored ``sum of log-probs / generated_length ** length_penalty``, is kept if
among the ``k`` best finished. All as ``GenerationMixin._beam_search`` does it, so the sequences and
scores are ``model.generate``'s.
"""

from __future__ import annotations

import torch

from .decoding import Decoding

__all__ = ["BeamSelection"]

NEG = -1.0e9  # transformers' "impossible" score (finite, so that sums stay ordered)


class BeamSelection:
    """Per prompt the ``k`` running beams and the ``k`` best finished hypotheses, ``[batch, k, ...]`` each."""

    def __init__(self, input_ids: torch.Tensor, decoding: Decoding, eos: torch.Tensor, pad: int, max_new_tokens: int):
        device, (batch, self.width), k = input_ids.device, input_ids.shape, decoding.num_beams
        self.decoding, self.eos, self.k = decoding, eos, k
        self.cur_len, self.max_length = self.width, self.width + max_new_tokens
        self.keep = max(2, 1 + eos.numel()) * k  # candidates per prompt: 2k (more with several EOS ids)
        fill = pad if pad != 0 else (int(eos[0]) if eos.numel() else pad)  # model.generate's fill value
        self.running = torch.full((batch, k, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, : self.width] = input_ids[:, None, :]  # [batch, k, max_length]
        self.running_scores = torch.zeros(batch, k, device=device)  # [batch, k]
        self.running_scores[:, 1:] = NEG  # step 0: the k rows are one prompt; only beam 0's candidates count
        self.finished = self.running.clone()  # [batch, k, max_length]
        self.finished_len = torch.zeros(batch, k, dtype=torch.long, device=device)  # generated lengths
        self.finished_scores = torch.full((batch, k), NEG, device=device)
        self.is_finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
        self.can_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)  # per prompt

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Select from ``logits: [batch * k, vocab]``; returns the token each next beam appends and
        the beam it continues (``[batch, k]`` each), and per prompt whether it is done."""
        batch, k, width, cur_len = self.running.shape[0], self.k, self.width, self.cur_len
        penalty, early_stopping = self.decoding.length_penalty, self.decoding.early_stopping
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits, dim=-1).view(batch, k, vocab) + self.running_scores[:, :, None]
        top_scores, top_index = torch.topk(log_probs.view(batch, k * vocab), k=self.keep)  # [batch, keep]
        top_beam, top_token = top_index // vocab, top_index % vocab
        top_running = self.running.gather(1, top_beam[:, :, None].expand(-1, -1, self.max_length)).clone()
        top_running[:, :, cur_len] = top_token
        hits = torch.isin(top_token, self.eos) | (cur_len + 1 >= self.max_length)  # [batch, keep]: ends here

        # the next running beams: the k best candidates that do not end
        running_candidates = top_scores + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_candidates, k=k)[1]  # [batch, k]
        self.running = _gather(top_running, nxt)
        self.running_scores = _gather(running_candidates, nxt)
        parents = _gather(top_beam, nxt)  # [batch, k]

        # the k best finished hypotheses so far (only the k best candidates may finish), length-penalized
        just_finished = hits & (torch.arange(self.keep, device=hits.device) < k)[None, :]
        scores = top_scores / ((cur_len + 1 - width) ** penalty)
        scores += (self.is_finished.all(dim=-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * NEG
        scores += (~self.can_improve).to(torch.float32) * NEG
        scores += (~just_finished) * NEG
        best = torch.topk(torch.cat((self.finished_scores, scores), dim=1), k=k)[1]  # [batch, k]
        self.finished = _gather(torch.cat((self.finished, top_running), dim=1), best)
        self.finished_scores = _gather(torch.cat((self.finished_scores, scores), dim=1), best)
        new_len = torch.full_like(top_beam, cur_len + 1 - width)
        self.finished_len = _gather(torch.cat((self.finished_len, new_len), dim=1), best)
        self.is_finished = _gather(torch.cat((self.is_finished, just_finished), dim=1), best)

        self.cur_len = cur_len = cur_len + 1
        # transformers' early-stop heuristic: can the best running beam still beat the worst finished one?
        best_length = self.max_length - width if early_stopping == "never" and penalty > 0.0 else cur_len - width
        best_running = self.running_scores[:, :1] / (best_length**penalty)  # [batch, 1]
        worst = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], NEG)
        self.can_improve &= torch.any(best_running > worst, dim=-1, keepdim=True)
        stop = not (
            bool(self.can_improve.any())
            and not (bool(self.is_finished.all()) and early_stopping is True)
            and not bool(hits.all())
        )
        done = [stop or not bool(self.can_improve[b]) for b in range(batch)]  # nothing it runs can change its result
        return self.running[:, :, cur_len - 1], parents, done

    def best(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` best finished hypotheses of each prompt, ``[batch * n, width + longest]``, and their scores."""
        out_len = self.width + int(self.finished_len[:, :n].max())
        return self.finished[:, :n, :out_len].reshape(-1, out_len), self.finished_scores[:, :n].reshape(-1)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[b, index[b, j], ...]`` for a ``[batch, n, ...]`` tensor and ``index: [batch, m]``."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)
