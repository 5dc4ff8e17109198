"""Scenarios as data, the page map (snapshot and drawing) and notebook 02's widget callback."""

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_ref.allocator import OutOfPagesError
from paged_ref.block_table import pages_needed
from paged_ref.cache import PagedKVCache
from paged_ref.lab.scenarios import ScenarioPlayer, Step, add, finish, fork, grow, random_scenario
from paged_ref.lab.viz.pages import _format_table, page_map, page_map_figure, page_map_story
from paged_ref.lab.widgets.pages import PAGE_SIZES, page_map_panel, page_map_view, page_scenario


def make(num_pages=8, page_size=4, **kw):
    return PagedKVCache(num_layers=2, num_pages=num_pages, page_size=page_size, num_kv_heads=2, head_dim=3, **kw)


# --------------------------------------------------------------------------- scenarios
def test_player_fork_copy_on_write_and_finish():
    cache = make()
    player = ScenarioPlayer(cache)
    player.run([add("A", 6), fork("B", "A")])
    assert cache.pages(player.seq_id("B")) == cache.pages(player.seq_id("A")) == [0, 1]
    player.apply(grow("A", 1))  # A writes into the shared half-full page 1: it gets a copy
    assert cache.pages(player.seq_id("A")) == [0, 2] and cache.pages(player.seq_id("B")) == [0, 1]
    assert cache.allocator.refcount(0) == 2 and cache.allocator.refcount(1) == 1
    assert len(player.tokens["A"]) == 7 and player.tokens["B"] == player.tokens["A"][:6]
    player.check()
    player.apply(finish("B"))
    assert player.names == {player.seq_id("A"): "A"} and cache.allocator.refcount(0) == 1
    player.check()


def test_player_check_detects_a_corrupted_cache():
    cache = make()
    player = ScenarioPlayer(cache)
    slots = player.apply(add("A", 5))
    player.check()
    cache.k_cache[1].view(-1, 2, 3)[int(slots[3]), 1, 2] += 1.0  # one channel of one head
    with pytest.raises(AssertionError, match="A: K of layer 1"):
        player.check()


def test_player_prefix_caching_reuses_full_pages():
    cache = make(num_pages=16, prefix_caching=True)
    player = ScenarioPlayer(cache)
    system = list(range(1, 9))  # two full pages of 4
    player.apply(add("A", system + [20, 21, 22]))
    player.apply(add("B", system + [30]))
    a, b = player.seq_id("A"), player.seq_id("B")
    assert cache.prefix_hits == 2 and cache.pages(b)[:2] == cache.pages(a)[:2]
    assert cache.pages(b)[2] not in cache.pages(a)
    player.check()  # B's reused pages hold exactly what B's own prefill would have written
    player.run([add("C", 12), add("D", 12)])  # counted prompts get fresh ids: never a hit
    assert cache.prefix_hits == 2 and player.tokens["C"] != player.tokens["D"]
    player.check()


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("growth", ["page", "pow2"])
def test_random_scenarios_keep_the_cache_exact(page_size, growth):
    for seed in range(6):
        cache = make(num_pages=400 // page_size, page_size=page_size, growth=growth)
        player = ScenarioPlayer(cache)
        for step in random_scenario(5, seed):
            player.apply(step)
            player.check()
        pm = page_map(cache, player.names)
        for p in range(pm.num_pages):  # nothing but the block tables holds references here
            assert pm.refcount[p] == len(pm.owners[p])


def test_failed_steps_change_nothing():
    cache = make(num_pages=3)
    player = ScenarioPlayer(cache)
    player.apply(add("A", 8))
    before = (cache.seq_ids, cache.allocator.num_free, dict(player.tokens), len(player.history))
    with pytest.raises(OutOfPagesError):
        player.apply(add("B", 9))  # needs 3 pages, 1 is free
    with pytest.raises(OutOfPagesError):
        player.apply(grow("A", 5))
    with pytest.raises(ValueError, match="already called 'A'"):
        player.apply(add("A", 1))
    with pytest.raises(ValueError, match="no live sequence named 'Z'"):
        player.apply(grow("Z"))
    with pytest.raises(TypeError, match="step must be a Step"):
        player.apply(("grow", "A"))
    assert (cache.seq_ids, cache.allocator.num_free, dict(player.tokens), len(player.history)) == before
    player.check()
    player.apply(add("B", 2))  # failed steps used up no fresh ids
    assert player.tokens["B"] == [player.tokens["A"][-1] + 1, player.tokens["A"][-1] + 2]


def test_step_validation():
    with pytest.raises(ValueError, match="op must be one of"):
        Step("shrink", "A")
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        Step("add", "A")
    with pytest.raises(ValueError, match="prompt must be a positive count or a non-empty list"):
        add("A", [])
    with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 8192\), got \[9000\]"):
        add("A", [1, 9000])
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        grow("A", 0)
    with pytest.raises(ValueError, match="parent must name"):
        Step("fork", "B")
    with pytest.raises(ValueError, match="seq must be a non-empty name"):
        add("", 3)
    with pytest.raises(ValueError, match="prompt must be >= 1"):
        add("A", 0)
    assert [s.describe() for s in (add("A", [5, 6]), add("A", 3), grow("A"), fork("B", "A"), finish("B"))] == [
        "add A (2-token prompt)",
        "add A (3-token prompt)",
        "grow A by 1 token",
        "fork B from A",
        "finish B",
    ]


def test_random_scenario_shape():
    steps = random_scenario(4, seed=3, max_prompt=10, max_decode=5)
    assert steps == random_scenario(4, seed=3, max_prompt=10, max_decode=5)
    assert steps != random_scenario(4, seed=4, max_prompt=10, max_decode=5)
    assert [s.seq for s in steps if s.op == "add"] == ["A", "B", "C", "D"]
    assert [s.seq for s in steps if s.op == "finish"] == ["B"]
    assert [(s.seq, s.parent) for s in steps if s.op == "fork"] == [("A'", "A")]
    player = ScenarioPlayer(make(num_pages=64))
    player.run(steps)
    assert all(4 <= len(t) <= 15 for t in player.tokens.values())
    with pytest.raises(ValueError, match="num_seqs must be >= 1"):
        random_scenario(0)
    with pytest.raises(ValueError, match="num_seqs must be <= 26"):
        random_scenario(27)
    with pytest.raises(TypeError, match="seed must be an int"):
        random_scenario(2, seed=1.5)


# --------------------------------------------------------------------------- page map
def test_page_map_states_owners_and_fill():
    cache = make(num_pages=8, page_size=4)
    a = cache.add_sequence()
    cache.reserve(a, 6)  # pages 0, 1 (2 tokens in page 1)
    b = cache.add_sequence()
    cache.reserve(b, 4)  # page 2, full
    c = cache.fork(a)  # shares 0 and 1
    cache.free(b)  # page 2 goes to the free list
    pm = page_map(cache, names={a: "A"})
    assert pm.status == ("used", "used", "returned") + ("never",) * 5
    assert pm.refcount[:3] == (2, 2, 0) and pm.owners[:3] == ((a, c), (a, c), ())
    assert pm.fill[:3] == (4, 2, 0) and pm.bump == 3 and pm.shared == (0, 1)
    assert pm.tables == {a: (0, 1), c: (0, 1)} and pm.seq_lens == {a: 6, c: 6}
    assert pm.names == {a: "A", c: f"seq {c}"}
    assert (pm.count("used"), pm.count("returned"), pm.count("never")) == (2, 1, 5)
    assert (pm.stored_tokens, pm.held_slots) == (6, 8)


def test_page_map_pages_reserved_ahead_hold_no_tokens():
    cache = make(num_pages=8, page_size=4, growth="pow2")
    s = cache.add_sequence()
    cache.reserve(s, 9)  # needs 3 pages, pow2 reserves 4
    pm = page_map(cache)
    held = pages_needed(9, 4)
    assert len(pm.tables[s]) == 4 and pm.fill[:4] == (4, 4, 1, 0)
    assert _format_table(pm.tables[s], held) == "[0, 1, 2, (3)]"
    assert _format_table(list(range(40)), 40) == "[0, 1, 2, 3, 4, 5, 6, 7, ..., 39]  (40 pages)"


def _black_frames(fig):
    return [
        p
        for ax in fig.axes
        for p in ax.patches
        if isinstance(p, Rectangle) and p.get_linewidth() == 1.6 and p.get_edgecolor()[:3] == (0, 0, 0)
    ]


def test_page_map_figure_marks_shared_pages_and_lists_tables():
    cache = make(num_pages=8, page_size=4)
    a = cache.add_sequence()
    cache.reserve(a, 9)
    b = cache.fork(a)
    cache.reserve(b, 1)  # copies the shared last page: pages 0 and 1 stay shared
    pm = page_map(cache, names={a: "A", b: "B"})
    fig = page_map_figure(pm, title="after fork")
    assert isinstance(fig, Figure) and len(_black_frames(fig)) == len(pm.shared) == 2
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "   A len   9: [0, 1, 2]" in texts and "   B len  10: [0, 1, 3]" in texts
    assert texts.count("x2") == 2
    story = page_map_story([pm, pm], ["one", "two"])
    assert len(_black_frames(story)) == 4
    with pytest.raises(ValueError, match="equal length"):
        page_map_story([pm], ["one", "two"])
    with pytest.raises(ValueError, match="cols must be a positive int"):
        page_map_figure(pm, cols=0)


# --------------------------------------------------------------------------- widget callback
def test_page_scenario_is_pure_and_uses_the_pool():
    for ps in PAGE_SIZES:
        r = page_scenario(ps, 4, seed=2, pool_tokens=160)
        assert r == page_scenario(ps, 4, seed=2, pool_tokens=160)
        assert r.complete and r.steps_run == len(r.steps) == len(random_scenario(4, 2))
        assert r.page_map.num_pages == 160 // ps and r.page_map.page_size == ps
        # the sequences' lengths do not depend on the page size; what is stored (copy-on-write
        # duplicates part of a shared page) and the held-but-empty slots do
        lens = page_scenario(1, 4, seed=2).page_map.seq_lens
        assert r.page_map.seq_lens == lens and r.page_map.stored_tokens <= sum(lens.values())
        assert r.wasted_slots == r.page_map.held_slots - r.page_map.stored_tokens >= 0
    assert page_scenario(1, 4, seed=2).wasted_slots == 0


def test_page_scenario_stops_when_the_pool_is_full():
    r = page_scenario(16, 8, seed=0, pool_tokens=64)
    assert not r.complete and r.steps_run < len(r.steps)
    assert r.stopped_at == r.steps[r.steps_run] and r.stopped_at.op in ("add", "grow")
    free = r.page_map.count("never") + r.page_map.count("returned")
    if r.stopped_at.op == "add":  # the failing step needed more pages than were free
        assert pages_needed(r.stopped_at.prompt_len, 16) > free
    else:
        assert r.stopped_at.seq in r.page_map.names.values() and free <= 1
    fig = page_map_view(16, 8, seed=0, pool_tokens=64)
    assert f"POOL FULL at step {r.steps_run + 1}/{len(r.steps)}" in fig.axes[0].get_title(loc="left")


def test_page_map_view_changes_with_page_size():
    small, large = page_map_view(2, 3, seed=1), page_map_view(16, 3, seed=1)
    assert "in 80 pages of 2" in small.axes[0].get_title(loc="left")
    assert "in 10 pages of 16" in large.axes[0].get_title(loc="left")


def test_widget_callback_validation():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        page_scenario(0, 2)
    with pytest.raises(ValueError, match="page_size must be <= pool_tokens=160"):
        page_scenario(256, 2)
    with pytest.raises(TypeError, match="page_size must be an int"):
        page_scenario(4.0, 2)
    with pytest.raises(ValueError, match="num_seqs must be >= 1"):
        page_map_view(4, 0)


def test_panel_wires_sliders_without_continuous_update():
    panel = page_map_panel(page_size=8, num_seqs=2)
    sliders = panel.children[0].children
    assert [s.description for s in sliders] == ["page size", "requests", "seed"]
    assert all(s.continuous_update is False for s in sliders) and sliders[0].value == 8
