"""Notebook 08's recording and figures: PageTracer on a tiny Llama, the trace's figures, the scrub widget."""

import pytest
import torch
from matplotlib.figure import Figure

from paged_ref import PagedKVCache, hf
from paged_ref.block_table import pages_needed
from paged_ref.lab.viz.generation import (
    GenerationTrace,
    PageTracer,
    generation_story_figure,
    logprob_figure,
    pages_over_steps_figure,
    story_indices,
)
from paged_ref.lab.widgets.generation import trace_panel, trace_view
from paged_ref.models import tiny_llama

PAGE = 4


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _kv(num_pages=40):
    return PagedKVCache(num_layers=2, num_pages=num_pages, page_size=PAGE, num_kv_heads=2, head_dim=32)


def _batch(lengths, seed=0):
    """Left-padded random prompts: (input_ids, attention_mask) [batch, max_len]."""
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, 512, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def _eos_batch(model):
    """A batch where row 1 ends early: its token at step 3 is made the EOS id."""
    ids, mask = _batch([5, 9, 2], seed=2)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
    eos = int(free[1, ids.shape[1] + 3])
    return ids, mask, eos


def _trace(model, names=("A", "B", "C"), new=10, **tracer_kw):
    ids, mask, eos = _eos_batch(model)
    kv = _kv()
    tracer = PageTracer(kv, names=list(names), **tracer_kw)
    out = hf.generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        kv_cache=kv,
        callback=tracer,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return tracer.finish(), kv, ids, mask, out, eos


@pytest.fixture(scope="module")
def traced(model):
    """One traced generation of the EOS batch, shared by the tests that only read it."""
    return _trace(model)


# --------------------------------------------------------------------------- the tracer
def test_tracer_records_what_the_cache_held_at_every_step(traced):
    trace, kv, ids, mask, out, eos = traced
    lengths = mask.sum(1).tolist()
    steps = out.shape[1] - ids.shape[1]
    assert trace.steps == tuple(range(steps)) + (None,)
    assert trace.names == ("A", "B", "C") and len(trace.maps) == steps + 1
    generated = out[:, ids.shape[1] :]
    for row, name in enumerate(trace.names):
        ended = (generated[row] == eos).nonzero()
        last = int(ended[0]) if len(ended) else None  # the step whose token was EOS
        for i, step in enumerate(trace.steps[:-1]):
            # at step s a live row holds its prompt + s tokens; a row is freed after emitting EOS
            alive = last is None or step <= last
            assert trace.tokens_held[name][i] == (lengths[row] + step if alive else 0)
            assert trace.pages_held[name][i] == pages_needed(trace.tokens_held[name][i], PAGE)
        assert trace.tokens_held[name][-1] == trace.pages_held[name][-1] == 0
    held = [sum(trace.pages_held[n][i] for n in trace.names) for i in range(len(trace.steps))]
    assert [kv.num_pages - h for h in held] == list(trace.free_pages)
    assert trace.free_pages[-1] == kv.num_pages and kv.seq_ids == []
    # row B emitted EOS at step 3, so it holds nothing from step 4 on
    assert trace.finished_at() == {"A": None, "B": 4, "C": None}
    assert trace.maps[0].stored_tokens == sum(lengths)
    assert trace.maps[-1].count("used") == 0
    assert trace.recycled_pages() == []  # a roomy pool: the bump pointer never reached the end


def test_a_tight_pool_reuses_the_pages_of_a_finished_sequence(model):
    """Without reuse the batch would need 10 pages (A 4, B 3, C 3); B ends at step 3 and its pages
    go to the free list; in a pool of 9 the bump pointer runs out and a returned page is handed out again."""
    ids, mask, eos = _eos_batch(model)
    kv = _kv(num_pages=9)
    tracer = PageTracer(kv, names=["A", "B", "C"])
    out = hf.generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        kv_cache=kv,
        callback=tracer,
        eos_token_id=eos,
        pad_token_id=0,
    )
    trace = tracer.finish()
    assert torch.equal(
        out,
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0),
    )
    recycled = trace.recycled_pages()
    assert len(recycled) == 1
    page, b = recycled[0], trace.seq_ids[1]
    assert b in trace.maps[0].owners[page]  # B's page at first ...
    assert any(pm.owners[page] and b not in pm.owners[page] for pm in trace.maps)  # ... then A's or C's
    holders = trace.page_holders(page)
    assert holders[0] == "B" and len(holders) == 2 and holders[1] in ("A", "C")
    assert trace.page_holders(kv.num_pages - 1) in (["A"], ["B"], ["C"])  # the last fresh page: one holder
    with pytest.raises(ValueError, match=r"page must be an int in \[0, 9\)"):
        trace.page_holders(9)


def test_tracer_ignores_sequences_that_were_in_the_cache_before(model):
    kv = _kv()
    other = kv.add_sequence()
    kv.reserve(other, 6)
    tracer = PageTracer(kv)
    hf.generate(model, torch.tensor([[1, 5, 9]]), max_new_tokens=3, kv_cache=kv, callback=tracer, eos_token_id=[])
    trace = tracer.finish()
    assert trace.names == ("seq 0",) and trace.seq_ids != (other,)
    assert trace.tokens_held["seq 0"] == [3, 4, 5, 0]
    assert trace.free_pages[-1] == kv.num_pages - 2  # the other sequence still holds its 2 pages


def test_tracer_bad_input(model):
    with pytest.raises(TypeError, match="kv must be a paged_ref.PagedKVCache"):
        PageTracer("cache")
    with pytest.raises(TypeError, match="names must be a sequence of str"):
        PageTracer(_kv(), names="AB")
    with pytest.raises(ValueError, match="live_every must be >= 1"):
        PageTracer(_kv(), live_every=0)
    kv = _kv()
    tracer = PageTracer(kv, names=["only one"])
    ids, mask = _batch([3, 4])
    with pytest.raises(ValueError, match="names has 1 entries but the batch has 2 rows"):
        hf.generate(model, ids, attention_mask=mask, max_new_tokens=2, kv_cache=kv, callback=tracer)
    assert kv.seq_ids == [] and kv.allocator.num_free == kv.num_pages  # generate freed everything
    with pytest.raises(RuntimeError, match="no step was recorded"):
        PageTracer(_kv()).finish()
    with pytest.raises(ValueError, match="found 0"):  # a different cache than generate's
        hf.generate(model, ids, attention_mask=mask, max_new_tokens=2, callback=PageTracer(_kv()))


def test_tracer_finish_is_idempotent_and_closes_the_tracer(model):
    kv = _kv()
    tracer = PageTracer(kv)
    hf.generate(model, torch.tensor([[1, 5]]), max_new_tokens=2, kv_cache=kv, callback=tracer, eos_token_id=[])
    first, second = tracer.finish(), tracer.finish()
    assert first.steps == second.steps == (0, 1, None)
    with pytest.raises(RuntimeError, match="finished"):
        tracer(2, torch.tensor([3]))


def test_live_view_draws_every_n_steps_into_one_display(model, monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, fig):
            shown.append(("update", fig))

    def fake_display(fig, display_id=False):
        shown.append(("display", fig))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", fake_display)
    kv = _kv()
    tracer = PageTracer(kv, live_every=2)
    hf.generate(model, torch.tensor([[1, 5, 9]]), max_new_tokens=5, kv_cache=kv, callback=tracer, eos_token_id=[])
    tracer.finish()
    # steps 0, 2, 4 and the final state: one display, then updates of the same output
    assert [kind for kind, _ in shown] == ["display", "update", "update", "update"]
    assert all(isinstance(fig, Figure) for _, fig in shown)
    assert "after generate returned" in shown[-1][1].axes[0].get_title(loc="left")


# --------------------------------------------------------------------------- figures
def test_pages_over_steps_figure_stacks_each_sequence(traced):
    trace, *_ = traced
    fig = pages_over_steps_figure(trace)
    top = fig.axes[0]
    assert len(top.collections) == len(trace.names)  # one stacked band per sequence
    labels = top.get_legend_handles_labels()[1]
    assert labels[:3] == ["A", "B", "C"] and labels[3] == f"pool: {trace.num_pages} pages"
    assert any("B ends" in t.get_text() for t in top.texts) and not any("A ends" in t.get_text() for t in top.texts)
    with pytest.raises(TypeError, match="GenerationTrace"):
        pages_over_steps_figure({"steps": []})


def test_story_indices_include_prefill_end_and_early_finishes(traced):
    trace, *_ = traced
    idx = story_indices(trace, max_panels=4)
    last = len(trace.steps) - 1
    assert idx == [0, trace.steps.index(4), last - 1, last]  # prefill, B's end, last decode step, the end
    assert idx == sorted(set(idx))
    fig = generation_story_figure(trace, idx)
    titles = [ax.get_title(loc="left") for ax in fig.axes[::2]]
    assert titles[0].startswith("after the prefill") and titles[-1].startswith("after generate returned")
    with pytest.raises(ValueError, match="snapshot indices"):
        generation_story_figure(trace, [0, last + 1])
    with pytest.raises(ValueError, match="max_panels must be >= 3"):
        story_indices(trace, max_panels=2)


def test_logprob_figure_reports_max_difference_and_exact_zeros():
    plain = torch.linspace(-5, -1, 20)
    same = plain.clone()
    off = plain.clone()
    off[7] += 3e-5
    fig = logprob_figure(plain[None], {"same": same, "off": off[None]}, tolerance=1e-4)
    titles = [ax.get_title(loc="left") for ax in fig.axes[1:]]  # one strip per variant
    assert titles == [
        "same: max 0.0e+00, mean 0.0e+00, 100% exactly 0",
        "off: max 3.0e-05, mean 1.5e-06, 95% exactly 0",
    ]
    # the strip draws every token; an exact 0 at the floor
    ys = fig.axes[2].lines[0].get_ydata()
    assert len(ys) == 20 and ys[7] == pytest.approx(3e-5, rel=1e-2) and ys[0] == 1e-9
    with pytest.raises(ValueError, match=r"paged\['x'\] has shape \[3\]"):
        logprob_figure(plain, {"x": plain[:3]}, tolerance=1e-4)
    with pytest.raises(ValueError, match="at least one label"):
        logprob_figure(plain, {}, tolerance=1e-4)
    with pytest.raises(TypeError, match="plain must be a floating torch.Tensor"):
        logprob_figure([0.1, 0.2], {"x": plain}, tolerance=1e-4)


# --------------------------------------------------------------------------- the widget callback
def test_trace_view_draws_the_chosen_snapshot(traced):
    trace, *_ = traced
    first, last = trace_view(trace, 0), trace_view(trace, -1)
    n = len(trace.maps)
    assert first.axes[0].get_title(loc="left") == f"snapshot 0/{n - 1}: {trace.title(0)}"
    assert last.axes[0].get_title(loc="left").startswith(f"snapshot {n - 1}/{n - 1}: after generate returned")
    # the map drawn is the snapshot's: used cells of the first map are colored, none in the last
    assert trace.maps[0].count("used") > 0 and trace.maps[-1].count("used") == 0
    for bad in (n, -n - 1, 1.0, True):
        with pytest.raises(ValueError, match="index must be an int"):
            trace_view(trace, bad)
    with pytest.raises(TypeError, match="GenerationTrace"):
        trace_view(None, 0)
    panel = trace_panel(trace, index=2)
    assert panel.children[0].value == 2 and panel.children[0].max == n - 1
    with pytest.raises(ValueError, match="index must be an int"):
        trace_panel(trace, index=n)


def test_trace_title_counts_live_sequences():
    trace = GenerationTrace(
        names=("A", "B"),
        seq_ids=(0, 1),
        steps=(0, 1, None),
        pages_held={"A": [2, 0, 0], "B": [1, 1, 0]},
        tokens_held={"A": [5, 0, 0], "B": [3, 4, 0]},
        free_pages=(5, 7, 8),
        maps=(),
        num_pages=8,
        page_size=4,
    )
    assert trace.title(0) == "after the prefill: 2 live sequence(s), 3 pages held"
    assert trace.title(1) == "decode step 1: 1 live sequence(s), 1 pages held"
    assert trace.title(2) == "after generate returned: 8 of 8 pages free"
    assert trace.finished_at() == {"A": 1, "B": None}
