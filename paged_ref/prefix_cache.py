"""Prefix caching: which physical page already holds a given full page of tokens.

Two prompts that start with the same tokens have the same K/V there, so a second sequence can share
the first one's full pages. Each full page's key stands for the whole prefix up to it:

    key(page i) = SHA-256(key(page i - 1), token ids of page i),   key(page -1) = the root

The root digests a namespace (model, adapter, user salt), so another model's K/V never matches; a
hit is confirmed by the page's token ids, never by a key alone. As in vLLM, a page is published as
soon as a reservation fills it: a sequence sharing it before the forward writes it reads what that
forward writes (each layer writes every row's K/V before any row attends). Until its last layer is
written it is ``unwritten``, the one kind of shared page a write may land in.

Example:
    >>> index = PrefixIndex(page_size=2)
    >>> root = namespace_key({"model": "m"})
    >>> key = page_key(root, (5, 6))
    >>> index.publish(page=3, key=key, tokens=(5, 6))
    >>> index.match(root, [5, 6, 7]) == [(3, key)]
    True
    >>> index.match(root, [5, 6])               # the last token is left for the caller to compute
    []
"""

from __future__ import annotations

import hashlib

__all__ = ["PrefixIndex", "namespace_key", "page_key"]

ROOT = b"paged_ref prefix cache v1"


def namespace_key(namespace, parent: bytes = ROOT, name: str = "prefix_namespace") -> bytes:
    """The root of a key chain: a digest of ``parent`` and ``namespace`` (None or a dict of str -> str);
    ``name``: the argument an error names."""
    if namespace is None:
        namespace = {}
    if not isinstance(namespace, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in namespace.items()
    ):
        raise TypeError(
            f"{name} must be None or a dict of str -> str (e.g. {{'model': ..., 'adapter': ...}}), got {namespace!r}"
        )
    h = hashlib.sha256(parent)
    for k, v in sorted(namespace.items()):  # each field tagged with its length: {"ab": "c"} != {"a": "bc"}
        for part in (k, v):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def page_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """SHA-256 over the parent page's key and this page's token ids (any Python ints)."""
    return hashlib.sha256(parent + repr(tokens).encode()).digest()


class PrefixIndex:
    """Key -> physical page for full pages whose tokens a reservation filled (see the module docstring)."""

    def __init__(self, *, page_size: int):
        self.page_size = page_size
        self.page_of: dict[bytes, dict[int, None]] = {}  # key -> its pages, first published first (not de-duplicated)
        self.key_of: dict[int, bytes] = {}  # physical page -> its key (the reverse of page_of)
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # physical page -> its token ids
        self.unwritten: set[int] = set()  # published pages whose K/V the forward has yet to write

    def match(self, root: bytes, token_ids: list[int]) -> list[tuple[int, bytes]]:
        """``(page, key)`` of each leading full page of ``token_ids`` the index holds, up to the first miss;
        the last token is always left out (the caller needs its logits, so it must compute it)."""
        ps, prev, found = self.page_size, root, []
        for i in range((len(token_ids) - 1) // ps):
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            key = page_key(prev, tokens)
            # confirm by the tokens, never trust a key alone
            page = next((p for p in self.page_of.get(key, ()) if self.tokens_of.get(p) == tokens), None)
            if page is None:
                break
            found.append((page, key))
            prev = key
        return found

    def publish(self, page: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """``page`` was just filled with ``tokens`` (chained key ``key``): offer it for reuse, beside
        any page that already holds that key; it is ``unwritten`` until `written` says otherwise."""
        self.forget(page)
        self.page_of.setdefault(key, {})[page] = None
        self.key_of[page] = key
        self.tokens_of[page] = tokens
        self.unwritten.add(page)

    def written(self, pages) -> None:
        """The forward has written ``pages``' K/V in every layer."""
        self.unwritten.difference_update(pages)

    def forget(self, page: int) -> None:
        """``page``'s contents change: it is no longer offered for reuse."""
        key = self.key_of.pop(page, None)
        self.tokens_of.pop(page, None)
        self.unwritten.discard(page)
        pages = self.page_of.get(key)
        if pages is not None:
            pages.pop(page, None)
            if not pages:
                del self.page_of[key]

    def snapshot(self) -> tuple:
        """The index's whole state, for `restore` (a rollback)."""
        page_of = {key: dict(pages) for key, pages in self.page_of.items()}  # publish and forget edit these
        return page_of, dict(self.key_of), dict(self.tokens_of), set(self.unwritten)

    def restore(self, snapshot: tuple) -> None:
        """Put the index back as `snapshot` saw it."""
        page_of, key_of, tokens_of, unwritten = snapshot
        self.page_of = {key: dict(pages) for key, pages in page_of.items()}
        self.key_of, self.tokens_of = dict(key_of), dict(tokens_of)
        self.unwritten = set(unwritten)

    def __contains__(self, page: int) -> bool:
        """Whether ``page`` holds a published prefix (its K/V is worth keeping when freed)."""
        return page in self.key_of
