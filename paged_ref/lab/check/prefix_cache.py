"""`check_prefix_cache`: exercise 6's prefix cache against `paged_ref.PagedKVCache(prefix_caching=True)`.

The student writes a pool with prefix caching (notebooks 08-09)::

    class MyPrefixCache:
        def __init__(self, num_pages, page_size, hash_fn): ...
        def start(self, seq_id, prompt): ...     # -> tokens found cached (the sequence now holds their pages)
        def append(self, seq_id, tokens): ...    # the sequence grows: pages taken, full pages published
        def pages(self, seq_id): ...             # -> its physical pages, in order
        def free(self, seq_id): ...              # its pages go back, last page first

A full page's key is ``hash_fn(parent_key, tuple(its tokens))`` (the first page's parent is ``b""``);
a lookup walks a new prompt's full pages (never its last token) and confirms every hit by the page's
tokens; a page is published once it is full; freed pages are handed out again never-used first, then
plain free pages (nothing cached: a partial page) oldest first, then pages holding a cached prefix,
least recently freed first.

The checker runs multi-turn chats over shared system prompts on small pools (the oldest sequence is
freed when a new one does not fit) through the student's class and through paged_ref's cache, and
compares, operation by operation, the cached tokens ``start`` finds and every page a sequence holds.
Hand-made hostile cases come first: a ``hash_fn`` that makes keys collide (`colliding_hash`), a
partial last page (never shared), a page freed and handed out again before its copy could be found,
the same tokens after another prefix, two pages holding one key, a miss followed by a page that would hit.
"""

from __future__ import annotations

import hashlib
import numbers
import random
from dataclasses import dataclass

from ..._arith import cdiv
from ...cache import PagedKVCache
from .report import (
    DEFAULT_TIME_LIMIT_S,
    CheckReport,
    Failure,
    NotImplementedYet,
    OverTime,
    Run,
    StudentError,
    check_count,
    raised_hint,
)

__all__ = ["HOSTILE_CASES", "chat_hits", "check_prefix_cache", "colliding_hash", "sha_hash"]


def sha_hash(parent: bytes, tokens: tuple) -> bytes:
    """A key that never collides in practice: SHA-256 of the parent key and the page's tokens."""
    return hashlib.sha256(parent + repr(tuple(tokens)).encode()).digest()


def colliding_hash(parent: bytes, tokens: tuple) -> bytes:
    """A hash that makes keys collide on purpose: a page's tokens in any order give the same key."""
    return hashlib.sha256(parent + repr(sorted(tokens)).encode()).digest()


@dataclass(frozen=True)
class Case:
    """A pool and its operations: ``("start", seq, prompt)`` (then the prompt's uncached rest is appended),
    ``("gen", seq, tokens)`` (appended one token at a time) and ``("free", seq)``."""

    num_pages: int
    page_size: int
    ops: tuple
    hash_name: str = "sha_hash"
    name: str = ""


S8 = tuple(range(100, 108))
HOSTILE_CASES = (
    Case(
        4,
        4,
        (
            ("start", 0, tuple(range(9))),
            ("free", 0),
            ("start", 1, tuple(range(50, 62))),
            ("free", 1),
            ("start", 2, tuple(range(9))),
        ),
        name="pages freed and handed out again before their cached prefix is found",
    ),
    Case(
        6,
        4,
        (
            ("start", 0, tuple(range(10))),
            ("free", 0),
            ("start", 1, tuple(range(11))),
            ("start", 2, tuple(range(8))),
        ),
        name="a partial last page (never shared) and a prompt of whole pages (its last token is computed)",
    ),
    Case(
        8,
        2,
        (
            ("start", 0, (7, 7, 5, 6, 9)),
            ("start", 1, (8, 8, 1)),
            ("start", 2, (8, 8, 5, 6, 3)),
        ),
        name="the same page of tokens after another prefix",
    ),
    Case(
        13,
        2,
        (
            ("start", 5, (7, 8, 9)),
            ("gen", 5, (6,)),
            ("start", 6, (7, 8, 9, 6, 1)),
            ("start", 0, (1, 2, 3)),
            ("start", 1, (1, 2, 3, 4, 5)),
            ("gen", 0, (4,)),
            ("start", 2, (1, 2, 3, 4, 9)),
            ("free", 1),
            ("free", 2),
            ("start", 3, tuple(range(20, 36))),
            ("free", 3),
            ("start", 4, (1, 2, 3, 4, 7)),
        ),
        name="pages filled by generated tokens, and one prefix computed twice (two pages, one key)",
    ),
    Case(
        8,
        4,
        (
            ("start", 0, S8 + (1, 2, 3, 4) + (11, 12, 13, 14, 15)),
            ("start", 1, S8 + (2, 1, 4, 3) + (21, 22, 23, 24, 25)),
            ("free", 0),
            ("start", 2, S8 + (2, 1, 4, 3) + (21, 22, 23, 24, 26)),
            ("free", 1),
            ("free", 2),
            ("start", 3, S8 + (1, 2, 3, 4) + (11, 12, 13, 14, 16)),
        ),
        "colliding_hash",
        "a forced key collision: (1, 2, 3, 4) and (2, 1, 4, 3) get one key",
    ),
    Case(
        8,
        4,
        (
            ("start", 0, S8[:4] + (1, 2, 3, 4) + (11, 12, 13, 14, 15)),
            ("start", 1, S8[:4] + (2, 1, 4, 3) + (11, 12, 13, 14, 16)),
        ),
        "colliding_hash",
        "a miss ends the walk: after a key collision with other tokens, the next page's key is a cached page's",
    ),
)
HASHES = {"sha_hash": sha_hash, "colliding_hash": colliding_hash}


def random_case(rng: random.Random) -> Case:
    """Multi-turn chats over shared system prompts, interleaved; tokens from a small vocabulary."""
    ps = rng.choice((2, 4))
    num_pages = rng.randint(5, 12)
    limit = (num_pages - 1) * ps  # a prompt that always fits an empty pool
    vocab = rng.choice((3, 8, 50))
    systems = [tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 3 * ps))) for _ in range(rng.randint(1, 2))]
    chats = [
        {"history": rng.choice(systems), "seq": None, "turns": rng.randint(1, 3)} for _ in range(rng.randint(2, 4))
    ]
    ops, next_seq = [], 0
    while any(c["turns"] or c["seq"] is not None for c in chats):
        c = rng.choice([c for c in chats if c["turns"] or c["seq"] is not None])
        if c["seq"] is None:
            user = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
            prompt = (c["history"] + user)[:limit]
            c["history"], c["seq"], c["left"], next_seq = prompt, next_seq, rng.randint(1, 4), next_seq + 1
            c["turns"] -= 1
            ops.append(("start", c["seq"], prompt))
        elif c["left"] and len(c["history"]) < limit:
            token = rng.randrange(vocab)
            c["history"] += (token,)
            c["left"] -= 1
            ops.append(("gen", c["seq"], (token,)))
        else:
            ops.append(("free", c["seq"]))
            c["seq"] = None
    return Case(num_pages, ps, tuple(ops))


# ---------------------------------------------------------------------------------------- what pages hold
class _Model:
    """What the reference's pages hold, for the hints: each page's whole prefix (its owner's tokens up
    to the page's end) while it keeps a published copy, and the state of every page before an op."""

    def __init__(self, num_pages: int):
        self.prefix: dict[int, tuple] = {}  # page -> owner tokens up to its end (full, published pages)
        self.decode_filled: set[int] = set()
        self.dups: set[int] = set()  # pages published while another page held the same prefix
        self.used: set[int] = set()
        self.plain: list[int] = []  # free, oldest first
        self.cached: list[int] = []

    def snapshot(self) -> tuple:
        return set(self.used), list(self.plain), list(self.cached)

    @staticmethod
    def state(snapshot: tuple, page: int, refcount: int) -> str:
        used, _, cached = snapshot
        if page not in used:
            return "never used"
        if refcount > 0:
            return "held"
        return "cached" if page in cached else "plain"


class _Reference:
    def __init__(self, case: Case):
        one = dict(num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = PagedKVCache(num_pages=case.num_pages, page_size=case.page_size, prefix_caching=True, **one)
        self.ids: dict[int, int] = {}
        self.tokens: dict[int, list] = {}
        self.model = _Model(case.num_pages)
        self.ps = case.page_size

    def fits(self, seq, n_tokens: int) -> bool:
        held = len(self.kv.pages(self.ids[seq])) if seq in self.ids else 0
        length = len(self.tokens.get(seq, ()))
        return cdiv(length + n_tokens, self.ps) - held <= self.kv.allocator.num_free

    def start(self, seq, prompt) -> int:
        self.ids[seq] = self.kv.add_sequence(token_ids=list(prompt))
        cached = self.kv.seq_len(self.ids[seq])
        self.tokens[seq] = list(prompt[:cached])
        for p in self.kv.pages(self.ids[seq]):
            self._unfree(p)
        return cached

    def append(self, seq, tokens, decode: bool) -> None:
        before = len(self.kv.pages(self.ids[seq]))
        self.kv.reserve(self.ids[seq], len(tokens), token_ids=list(tokens))
        self.kv.written(self.ids[seq])  # the tokens are computed: their pages hold K/V
        pages = self.kv.pages(self.ids[seq])
        for p in pages[before:]:  # handed out: whatever it cached is gone
            self._unfree(p)
            self.model.prefix.pop(p, None)
            self.model.decode_filled.discard(p)
            self.model.dups.discard(p)
            self.model.used.add(p)
        self.tokens[seq] += list(tokens)
        for i in range(len(self.tokens[seq]) // self.ps):
            if pages[i] not in self.model.prefix:
                prefix = tuple(self.tokens[seq][: (i + 1) * self.ps])
                if prefix in self.model.prefix.values():
                    self.model.dups.add(pages[i])
                self.model.prefix[pages[i]] = prefix
                if decode:
                    self.model.decode_filled.add(pages[i])

    def free(self, seq) -> None:
        pages = self.kv.pages(self.ids[seq])
        self.kv.free(self.ids.pop(seq))
        del self.tokens[seq]
        for p in reversed(pages):
            if self.kv.allocator.refcount(p) == 0 and p not in self.model.plain + self.model.cached:
                (self.model.cached if p in self.model.prefix else self.model.plain).append(p)

    def _unfree(self, p: int) -> None:
        for lst in (self.model.plain, self.model.cached):
            if p in lst:
                lst.remove(p)


# ---------------------------------------------------------------------------------------- hints
def _hit_hint(ref: _Reference, prompt, got_cached: int, got_pages: list, want_cached: int, want_pages, refs) -> str:
    ps, m = ref.ps, ref.model
    if got_cached % ps:
        return "only full pages are shared: the cached tokens are a whole number of pages (a partial last page never)"
    if got_cached > want_cached:
        if got_cached >= len(prompt) or (got_cached == len(prompt) - len(prompt) % ps and len(prompt) % ps == 0):
            return (
                "leave the prompt's last token to compute (its logits give the next token): look up only the full "
                "pages within the first len(prompt) - 1 tokens"
            )
        for i in range(want_cached // ps, min(got_cached // ps, len(got_pages))):
            page, want = got_pages[i], tuple(prompt[: (i + 1) * ps])
            held = m.prefix.get(page)
            if held == want:
                continue
            if held is not None and len(held) > len(want):
                return (
                    "the walk stops at the first miss: the pages found are the first ones of the prompt, in a row "
                    "(a later page's key chains through the missing one)"
                )
            if held is None:
                return (
                    "a page handed out again holds other tokens: forget its key (and stored tokens) when the pool "
                    "hands it out"
                )
            if held[-ps:] == want[-ps:]:
                return (
                    "the key chains the parent's key: key = hash_fn(parent_key, tokens), so the same tokens after "
                    "another prefix are another page"
                )
            return "a hit must be confirmed by the page's tokens, never by the key alone (keys can collide)"
        return "only pages whose whole prefix matches the prompt's are hits"
    if got_cached < want_cached:
        i = got_cached // ps
        page = want_pages[i]
        same_key = [
            p for p, pre in m.prefix.items() if p != page and len(pre) == (i + 1) * ps and pre[:-ps] == prompt[: i * ps]
        ]
        if page in m.dups or any(sorted(m.prefix[p][-ps:]) == sorted(prompt[i * ps : (i + 1) * ps]) for p in same_key):
            return (
                "several pages can hold one key (a collision, or the same prefix computed twice): keep them all and "
                "take the first published whose tokens match"
            )
        if refs.get(page, 0) == 0:
            return (
                "a freed page keeps its cached prefix until the pool hands it out again: the lookup finds it and "
                "takes it back from the free list"
            )
        if page in m.decode_filled:
            return "publish every page as soon as it is full, also one that generated tokens filled"
        return (
            "the lookup walks the prompt's full pages from the first (key = hash_fn(parent key, tuple(page tokens)), "
            'the first parent b""), takes each hit, and stops at the first miss'
        )
    return ""


def _page_hint(ref: _Reference, want: list, got: list, hits: int, refs: dict, snap: tuple) -> str:
    m = ref.model
    i = next(j for j in range(max(len(want), len(got))) if j >= len(want) or j >= len(got) or want[j] != got[j])
    if i >= len(want) or i >= len(got):
        return f"the sequence holds {len(want)} pages: one per page_size tokens, a new one when the last is full"
    if i < hits:
        return "two pages hold the prefix: take the one published first (still cached) whose tokens match"
    w, g = m.state(snap, want[i], refs.get(want[i], 0)), m.state(snap, got[i], refs.get(got[i], 0))
    if g == "held":
        return (
            f"page {got[i]} is held by a sequence: never hand it out (a hit adds a reference; a page is free only "
            "when its last holder frees it)"
        )
    if w == "never used":
        return "never-used pages are handed out first (a bump pointer: 0, 1, 2, ...), before any freed page"
    if w == "plain" and g == "cached":
        return (
            "a plain free page (nothing cached: a partial page) is handed out before a page that holds a cached "
            "prefix, so cached prefixes survive as long as possible"
        )
    if w == g == "plain":
        return "plain free pages are handed out oldest freed first (a queue, not a stack)"
    if w == g == "cached":
        return (
            "pages holding a cached prefix are handed out least recently freed first, and a sequence frees its pages "
            "last page first (tail first), so a chain loses its tail before its head"
        )
    if w == "cached" and g == "plain":
        return "a full page keeps its published prefix when freed: it goes with the cached pages, not the plain ones"
    return (
        "pages are handed out never-used first, then plain free pages oldest first, then cached ones least recently "
        "freed first"
    )


# ---------------------------------------------------------------------------------------- one case
def _pages_of(student, seq, run: Run, where: list):
    where[1] = f"{where[1]}\nc.pages({seq})"  # right after the call that changed them
    got = run.call(lambda: student.pages(seq))
    if not isinstance(got, (list, tuple)) or any(
        isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in got
    ):
        raise _Bad(f"pages(seq_id) returns a list of int page ids, got {got!r}"[:200])
    return [int(p) for p in got]


class _Bad(Exception):
    pass


def _play(cls, case: Case, run: Run, where: list) -> Failure | None:
    """Play ``case`` on the student's class and the reference; ``where`` is kept as ``[the calls
    shown so far, the call into the student's code under way]`` for a failure raised out of here."""
    calls = [0]
    base = HASHES[case.hash_name]

    def hash_fn(parent, tokens):
        calls[0] += 1
        if not isinstance(parent, bytes):
            raise TypeError(
                'hash_fn(parent_key, tokens): parent_key is bytes, b"" for a sequence\'s first page, then the key '
                f"hash_fn returned for the page before; got {parent!r}"
            )
        return base(parent, tokens)

    ref = _Reference(case)
    shown: list[str] = []
    where[:] = [shown, f"c = {getattr(cls, '__name__', 'Cache')}({case.num_pages}, {case.page_size}, {case.hash_name})"]
    student = run.call(cls, case.num_pages, case.page_size, hash_fn)
    shown.append(where[1])
    live: list = []  # seq ids in start order
    for op in case.ops:
        kind, seq = op[0], op[1]
        if kind == "free":
            if seq in ref.ids:
                ref.free(seq)
                live.remove(seq)
                where[1] = f"c.free({seq})"
                run.call(lambda s=seq: student.free(s))
                shown.append(where[1])
            continue
        if seq not in ref.ids and kind != "start":
            continue  # its sequence was freed for room: the chat ended there
        need = len(op[2])
        while not ref.fits(seq, need) and [s for s in live if s != seq]:
            oldest = next(s for s in live if s != seq)
            ref.free(oldest)
            live.remove(oldest)
            where[1] = f"c.free({oldest})   (for room)"
            run.call(lambda s=oldest: student.free(s))
            shown.append(where[1])
        if not ref.fits(seq, need):
            continue
        refs = {p: ref.kv.allocator.refcount(p) for p in range(case.num_pages)}
        snap = ref.model.snapshot()
        if kind == "start":
            prompt = op[2]
            want = ref.start(seq, prompt)
            live.append(seq)
            call = where[1] = f"c.start({seq}, {list(prompt)})"
            got = run.call(lambda: student.start(seq, list(prompt)))
            if isinstance(got, bool) or not isinstance(got, numbers.Integral):
                return _fail(
                    shown,
                    call,
                    f"returns {want}",
                    f"returned {got!r}"[:200],
                    "start returns the number of cached tokens it found (an int: pages found x page_size)",
                )
            want_pages = ref.kv.pages(ref.ids[seq])
            got_pages = _pages_of(student, seq, run, where)
            if got != want:
                hint = _hit_hint(ref, prompt, int(got), got_pages, want, want_pages, refs)
                if want and got == want // case.page_size and got_pages == want_pages:
                    hint = "start returns the number of cached tokens (pages found x page_size), not pages"
                return _fail(
                    shown, call, f"returns {want} (pages {want_pages})", f"returned {got} (pages {got_pages})", hint
                )
            if got_pages != want_pages:
                return _fail(
                    shown,
                    call,
                    f"pages {want_pages}",
                    f"pages {got_pages}",
                    _page_hint(ref, want_pages, got_pages, want // case.page_size, refs, snap),
                )
            shown.append(f"{call}   -> {want}")
            rest, hits = list(prompt[want:]), want // case.page_size
            steps = [rest] if rest else []
        else:
            steps, hits = [[t] for t in op[2]], 0
        for tokens in steps:
            if kind == "gen":
                refs = {p: ref.kv.allocator.refcount(p) for p in range(case.num_pages)}
                snap = ref.model.snapshot()
            else:  # the prompt's rest: the pages its hits revived are held now
                refs = {p: ref.kv.allocator.refcount(p) for p in range(case.num_pages)}
                snap = (snap[0], [p for p in snap[1] if not refs[p]], [p for p in snap[2] if not refs[p]])
            ref.append(seq, tokens, decode=kind == "gen")
            call = where[1] = f"c.append({seq}, {tokens})"
            run.call(lambda t=tokens: student.append(seq, list(t)))
            want_pages, got_pages = ref.kv.pages(ref.ids[seq]), _pages_of(student, seq, run, where)
            if got_pages != want_pages:
                return _fail(
                    shown,
                    call,
                    f"pages({seq}) = {want_pages}",
                    f"pages({seq}) = {got_pages}",
                    _page_hint(ref, want_pages, got_pages, hits, refs, snap),
                )
            shown.append(f"{call}   -> pages {want_pages}")
    if calls[0] == 0 and any(op[0] == "start" and len(op[2]) > case.page_size for op in case.ops):
        return _fail(
            shown,
            "(the whole case)",
            "hash_fn called for every full page",
            "never called",
            "key every full page with the hash_fn given to __init__: hash_fn(parent_key, tuple(tokens))",
        )
    return None


def _fail(shown: list, call: str, expected: str, got: str, hint: str) -> Failure:
    return Failure(_calls(shown, call), expected, got, hint)


def _calls(shown: list, call: str) -> str:
    """The calls made so far (the first and the last 12 of a long case) and ``call``, marked."""
    lines = shown if len(shown) <= 14 else [shown[0], f"... ({len(shown) - 13} calls)"] + shown[-12:]
    return "\n".join(lines + [f"{call}   <- here"])


def chat_hits(cls, *, turns: int = 4, page_size: int = 4, num_pages: int = 32) -> list[tuple[int, int]]:
    """A chat played on ``cls``: each turn's prompt is the whole conversation so far plus a new
    message; returns ``(prompt tokens, cached tokens found)`` per turn.

    Example:
        >>> from pathlib import Path
        >>> import paged_ref
        >>> from paged_ref.lab.check import load_solutions
        >>> folder = Path(paged_ref.__file__).parents[1] / "notebooks" / "exercises" / "solutions"
        >>> solutions = load_solutions(folder / "solutions.py")
        >>> chat_hits(solutions.StudentPrefixCache, turns=3)      # every full page of the conversation so far
        [(13, 0), (22, 16), (31, 24)]
    """
    cache = cls(num_pages, page_size, sha_hash)
    rng = random.Random(0)
    history: list[int] = [rng.randrange(1000) for _ in range(9)]  # a system prompt
    out = []
    for turn in range(turns):
        prompt = history + [rng.randrange(1000) for _ in range(4)]
        found = cache.start(turn, prompt)
        cache.append(turn, prompt[found:])
        answer = [rng.randrange(1000) for _ in range(5)]
        for t in answer:
            cache.append(turn, [t])
        cache.free(turn)
        out.append((len(prompt), found))
        history = prompt + answer
    return out


def check_prefix_cache(
    cls, *, seed: int = 0, cases: int = 150, time_limit: float | None = DEFAULT_TIME_LIMIT_S
) -> CheckReport:
    """Check exercise 6's prefix cache class against paged_ref's (see the module docstring).

    Args:
        cls: ``cls(num_pages, page_size, hash_fn)`` with ``start(seq_id, prompt) -> int``,
            ``append(seq_id, tokens)``, ``pages(seq_id) -> list[int]`` and ``free(seq_id)``.
        seed, cases: the random chats, run after the hand-made `HOSTILE_CASES`.
        time_limit: seconds per case, or None.
    """
    check_count("cases", cases)
    rng = random.Random(seed)
    all_cases = list(HOSTILE_CASES) + [random_case(rng) for _ in range(cases)]
    name = "prefix_cache"
    run = Run(name, len(all_cases), time_limit)
    for count, case in enumerate(all_cases, start=1):
        where: list = [[], ""]
        head = f"{case.name}: " if case.name else ""
        try:
            with run.case(count):
                failure = _play(cls, case, run, where)
        except NotImplementedYet:
            return run.finish(CheckReport(name, False, count, not_implemented=True))
        except OverTime:
            failure = run.over_time(f"{head}pool of {case.num_pages} pages of {case.page_size}", f"in {where[1]}")
        except _Bad as bad:
            failure = Failure(
                _calls(*where),
                "a list of page ids",
                str(bad),
                "pages(seq_id) returns the sequence's physical page ids, in order",
            )
        except StudentError as raised:
            failure = Failure(
                _calls(*where),
                "a result",
                f"raised {raised}",
                raised_hint(
                    raised,
                    "the class needs __init__(num_pages, page_size, hash_fn), start(seq_id, prompt) -> int, "
                    "append(seq_id, tokens), pages(seq_id) -> list and free(seq_id)",
                ),
            )
        if failure is not None:
            if head and not failure.case.startswith(head):
                failure.case = head + "\n" + failure.case
            return run.finish(CheckReport(name, False, count, failure))
    return run.finish(CheckReport(name, True, len(all_cases)))
