"""Random token prompts for the tests that generate on the tiny Llama (vocabulary 512)."""

import torch


def left_padded(lengths, seed=0, pad=0):
    """Random prompts of the given lengths, left-padded: (input_ids, attention_mask) [batch, max_len]."""
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, 512, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask
