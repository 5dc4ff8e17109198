"""Real English text that is already installed: the prose of CPython's own documentation.

`pydoc_data.topics` ships with every CPython (it is what `help("assert")` prints). Its prose
paragraphs make a deterministic, offline source of real English for log-likelihood checks,
prompts and the eviction evaluation, with no dataset download. The text is fixed for a given
Python version (different Python versions ship slightly different documentation).

Example:
    >>> from paged_ref.lab import textdata
    >>> text = textdata.english_text(200)          # the first 200 words of prose
    >>> len(text.split())
    200
    >>> batch = textdata.prompts(4, min_words=5, max_words=30)   # 4 prompts of different lengths
"""

from __future__ import annotations

import functools
import random
import re

__all__ = ["paragraphs", "english_text", "prompts"]

# A prose line: starts with a letter or quote, and is not grammar ("::="), a table or a heading rule.
_NOT_PROSE = re.compile(r"::=|^\s|^[*=\-+|]|>>>")


@functools.cache
def _all_paragraphs() -> tuple[str, ...]:
    from pydoc_data import topics  # part of the standard library

    out = []
    for name in sorted(topics.topics):
        for block in topics.topics[name].split("\n\n"):
            lines = block.split("\n")
            if not lines or any(_NOT_PROSE.search(line) for line in lines):
                continue  # code, grammar, tables, indented examples, heading underlines
            text = " ".join(" ".join(lines).split())  # one line, single spaces
            letters = sum(ch.isalpha() or ch == " " for ch in text)
            if letters < 0.85 * len(text) or not text.endswith((".", ":")):
                continue  # mostly symbols, or not a finished sentence
            out.append(text)
    return tuple(out)


def paragraphs(min_words: int = 20) -> list[str]:
    """Prose paragraphs of CPython's documentation topics, in a fixed order.

    Args:
        min_words: keep only paragraphs with at least this many words.

    Returns:
        list of str, each one paragraph joined onto a single line.

    Example:
        >>> len(paragraphs(20)) > 100
        True
    """
    if not isinstance(min_words, int) or isinstance(min_words, bool) or min_words < 1:
        raise ValueError(f"min_words must be a positive int, got {min_words!r}")
    return [p for p in _all_paragraphs() if len(p.split()) >= min_words]


def english_text(num_words: int, *, start: int = 0) -> str:
    """The first `num_words` words of prose, starting at paragraph `start`, paragraphs joined by blank lines.

    Args:
        num_words: how many whitespace-separated words to return (>= 1).
        start: index of the first paragraph (of `paragraphs(20)`), to take different passages.

    Example:
        >>> english_text(5)
        'These equivalences assume that "__debug__"'
    """
    if not isinstance(num_words, int) or isinstance(num_words, bool) or num_words < 1:
        raise ValueError(f"num_words must be a positive int, got {num_words!r}")
    paras = paragraphs(20)
    if not isinstance(start, int) or not 0 <= start < len(paras):
        raise ValueError(f"start must be an int in [0, {len(paras)}), got {start!r}")
    words_left, chosen = num_words, []
    for para in paras[start:] + paras[:start]:
        words = para.split()
        chosen.append(" ".join(words[:words_left]))
        words_left -= min(words_left, len(words))
        if words_left == 0:
            return "\n\n".join(chosen)
    raise ValueError(f"num_words={num_words} is more prose than pydoc_data.topics holds")


def prompts(n: int, *, min_words: int = 8, max_words: int = 40, seed: int = 0) -> list[str]:
    """`n` prompts of different lengths: the opening words of distinct paragraphs.

    Lengths are drawn uniformly from [min_words, max_words] with a seeded generator, so the
    same arguments always give the same prompts (on a given Python version).

    Args:
        n: number of prompts (>= 1).
        min_words, max_words: bounds on each prompt's word count.
        seed: seed of the generator choosing paragraphs and lengths.

    Example:
        >>> [len(p.split()) for p in prompts(3, min_words=4, max_words=4)]
        [4, 4, 4]
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}")
    paras = paragraphs(max_words)
    if n > len(paras):
        raise ValueError(f"n={n} is more than the {len(paras)} paragraphs with >= {max_words} words")
    rng = random.Random(seed)
    picks = rng.sample(range(len(paras)), n)
    return [" ".join(paras[i].split()[: rng.randint(min_words, max_words)]) for i in picks]
