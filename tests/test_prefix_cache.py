"""PrefixIndex on its own: a page is published when filled, written once the forward wrote it, and
never matched on a key alone."""

from paged_ref.prefix_cache import PrefixIndex, namespace_key, page_key


def _published(index, root, tokens, page):
    key = page_key(root, tuple(tokens))
    index.publish(page, key, tuple(tokens))
    return key


def test_published_when_filled_unwritten_until_written_and_withdrawn_by_forget():
    index, root = PrefixIndex(page_size=2), namespace_key(None)
    key = _published(index, root, [1, 2], page=7)
    assert index.match(root, [1, 2, 3]) == [(7, key)] and 7 in index and index.unwritten == {7}
    index.written([7, 9])  # a page that was never published changes nothing
    assert index.unwritten == set() and index.match(root, [1, 2, 3]) == [(7, key)]
    _published(index, root, [1, 2], page=7)  # filled again: unwritten again
    index.forget(7)
    assert index.match(root, [1, 2, 3]) == [] and 7 not in index and not index.unwritten


def test_chain_stops_at_the_first_miss_and_a_key_is_confirmed_by_its_tokens():
    index, root = PrefixIndex(page_size=2), namespace_key({"model": "m"})
    k0 = _published(index, root, [1, 2], page=0)
    _published(index, k0, [3, 4], page=1)
    assert [p for p, _ in index.match(root, [1, 2, 3, 4, 5])] == [0, 1]
    assert [p for p, _ in index.match(root, [1, 2, 9, 9, 5])] == [0]
    assert index.match(namespace_key({"model": "other"}), [1, 2, 3, 4, 5]) == []
    index.tokens_of[0] = (8, 8)  # as if another prefix sat in page 0 under the same key
    assert index.match(root, [1, 2, 3, 4, 5]) == []


def test_a_second_page_with_a_published_key_is_kept_and_serves_when_the_first_goes():
    """No de-duplication (as vLLM's cache): both pages are cached, the first published serves."""
    index, root = PrefixIndex(page_size=2), namespace_key(None)
    key = _published(index, root, [1, 2], page=0)
    _published(index, root, [1, 2], page=5)  # another sequence filled the same tokens into page 5
    assert list(index.page_of[key]) == [0, 5] and 0 in index and 5 in index
    assert index.match(root, [1, 2, 3]) == [(0, key)]
    index.forget(0)
    assert index.match(root, [1, 2, 3]) == [(5, key)]
    index.forget(5)
    assert key not in index.page_of and index.match(root, [1, 2, 3]) == []


def test_restore_brings_back_every_page_a_key_had():
    """A rollback after a page of a key was forgotten (freed and taken again) finds it again."""
    index, root = PrefixIndex(page_size=2), namespace_key(None)
    key = _published(index, root, [1, 2], page=0)
    saved = index.snapshot()
    index.forget(0)
    _published(index, root, [1, 2], page=3)
    index.restore(saved)
    assert list(index.page_of[key]) == [0] and index.match(root, [1, 2, 3]) == [(0, key)] and 3 not in index
