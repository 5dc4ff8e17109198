"""Figures for pages shared between the sequences of one request (notebook 08).

- :func:`beam_page_map_figure` draws a beam search from its `paged_ref.hf.BeamStep` records: on the
  left the beams over the steps (which beam continues which; a fork where one beam has two
  children, a cross where a beam is cut); on the right the pool over the steps, one row per
  physical page, each cell colored by the beams holding that page (a page shared by several
  beams is split into one band per beam), framed in black the step a beam received it by
  copy-on-write, and crossed in red the step a cut beam returned it.
- :func:`sharing_figure` draws ``python -m paged_ref.lab.bench sharing``'s JSON: pages held per step
  under the three designs, and the saving against no sharing next to the vLLM paper's ranges.

Example:
    >>> import torch
    >>> from paged_ref import hf
    >>> from paged_ref.models import tiny_llama
    >>> steps = []
    >>> _ = hf.beam_search(tiny_llama(), torch.tensor([[1, 5, 9, 4, 7]]), num_beams=3, max_new_tokens=6,
    ...                    page_size=2, callback=lambda step, s: steps.append(s))
    >>> fig = beam_page_map_figure(steps, title="3 beams, pages of 2")
    >>> len(steps)
    6
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from . import add_note
from .pages import seq_color

__all__ = ["PAPER_SAVINGS", "beam_page_map_figure", "sharing_figure"]

#: Memory saved by sharing in the vLLM paper (Kwon et al., SOSP 2023, section 6.3), as fractions.
PAPER_SAVINGS = {"sample": (0.061, 0.098), "beam": (0.376, 0.552)}

_DESIGNS = {  # JSON key -> (label, line style)
    "fork_cow": ("(a) fork + copy-on-write", "-"),
    "prefix_caching": ("(b) prefix caching, one request each", "--"),
    "no_sharing": ("(c) no sharing", ":"),
}


def beam_page_map_figure(steps: Sequence, *, batch_row: int = 0, title: str = "", note: str | None = None) -> Figure:
    """The beams and the pages they hold over the steps of one beam search (one prompt of the batch).

    Args:
        steps: the `paged_ref.hf.BeamStep` of every step, in order (what ``callback`` received).
        batch_row: which prompt of the batch to draw.
        title: the figure's title; note: a provenance line under it.
    """
    if not steps:
        raise ValueError("steps must hold at least one BeamStep")
    k = steps[0].tokens.shape[1]
    used = sorted(
        {p for st in steps for pages in st.pages.values() for p in pages} | {p for st in steps for p in st.freed}
    )
    fig = Figure(figsize=(13, max(5.0, 2.0 + 0.13 * len(used))), layout="constrained")
    tree, pool = fig.subplots(1, 2, width_ratios=[1, 2.2])
    # ------------------------------------------------------------------ left: the beams
    slots = {s: 0 for s in steps[0].pages}  # beam (seq id) -> its row on the left panel
    for st in steps:
        nxt = st.beams[batch_row] if st.beams else []
        parents = st.parents[batch_row].tolist()
        current = list(slots)
        for j, seq in enumerate(nxt):
            parent_seq = current[parents[j]] if len(current) > parents[j] else current[0]
            tree.plot([st.step, st.step + 1], [slots[parent_seq], j], color=seq_color(seq), lw=1.5)
            if seq in st.forked:
                tree.plot(st.step + 1, j, "o", color=seq_color(seq), ms=6, mec="black")
        for seq in st.cut:
            if seq in slots:
                tree.plot(st.step + 0.15, slots[seq], "x", color="tab:red", ms=9, mew=2)
        slots = {seq: j for j, seq in enumerate(nxt)}
    tree.set_xlabel("step (forward; 0 = the prompt's prefill)")
    tree.set_ylabel("beam (transformers' order after each step)")
    tree.set_yticks(range(k))
    tree.invert_yaxis()
    tree.set_title("beams: a line = a beam continued, o = forked, x = cut", fontsize=9)
    # ------------------------------------------------------------------ right: the pool
    row = {p: i for i, p in enumerate(used)}
    for st in steps:
        holders: dict[int, list[int]] = {}
        for seq, pages in st.pages.items():
            for p in pages:
                holders.setdefault(p, []).append(seq)
        copied = {p for pages in st.copied.values() for p in pages}
        for p, seqs in holders.items():
            width = 0.9 / len(seqs)
            for i, seq in enumerate(sorted(seqs)):
                pool.add_patch(
                    Rectangle((st.step - 0.45 + i * width, row[p] - 0.4), width, 0.8, color=seq_color(seq), lw=0)
                )
            if p in copied:
                pool.add_patch(Rectangle((st.step - 0.45, row[p] - 0.4), 0.9, 0.8, fill=False, ec="black", lw=2))
        by_cut = {p for seq in st.cut for p in st.pages.get(seq, [])}
        for p in st.freed:  # pages released when the search (or the prompt) ends are not marked
            if p in by_cut:
                pool.plot(st.step + 0.5, row[p], "x", color="tab:red", ms=7, mew=2)
    pool.set_xlim(-0.6, steps[-1].step + 1)
    pool.set_ylim(len(used) - 0.5, -0.5)
    pool.set_yticks(range(len(used)), [str(p) for p in used], fontsize=7)
    pool.set_xlabel("step (pages held after its forward)")
    pool.set_ylabel("physical page")
    pool.set_title(
        "pages: colored by the beams holding them (split = shared), framed = copied on write, x = freed by a cut",
        fontsize=9,
    )
    if title:
        fig.suptitle(title)
    if note:
        add_note(fig, note)
    return fig


def sharing_figure(data: dict, *, width: int = 4, prompt: str = "long") -> Figure:
    """Pages held per step (``width`` samples / beams on ``prompt``) and the saving at every width.

    Args:
        data: the JSON of ``python -m paged_ref.lab.bench sharing``.
        width: the number of samples / beams whose steps the top row draws.
        prompt: the prompt (``"short"`` or ``"long"``) of the top row.
    """
    runs = data["runs"]
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    for col, kind in enumerate(("sample", "beam")):
        ax = axes[0, col]
        run = next((r for r in runs if r["kind"] == kind and r["width"] == width and r["prompt"] == prompt), None)
        if run is not None:
            for design, (label, style) in _DESIGNS.items():
                ax.plot(run["pages"][design], style, label=label, lw=2)
            what = "samples" if kind == "sample" else "beams"
            ax.set_title(f"{width} {what}, {run['prompt_tokens']}-token prompt: pages held", fontsize=10)
            ax.set_xlabel("step (forward; 0 = the prompt's prefill)")
            ax.set_ylabel(f"pages of {data['page_size']} tokens")
            ax.legend(fontsize=8)
        ax = axes[1, col]
        lo, hi = PAPER_SAVINGS[kind]
        ax.axhspan(100 * lo, 100 * hi, color="0.85", label=f"vLLM paper: {100 * lo:.1f}-{100 * hi:.1f}%")
        for name in sorted({r["prompt"] for r in runs}):
            mine = sorted((r for r in runs if r["kind"] == kind and r["prompt"] == name), key=lambda r: r["width"])
            if not mine:
                continue
            tokens = mine[0]["prompt_tokens"]
            color = f"C{sorted({r['prompt'] for r in runs}).index(name)}"  # one color per prompt, a style per design
            for design, (label, style) in _DESIGNS.items():
                if design == "no_sharing":
                    continue
                values = [100 * r["saving_vs_no_sharing"][design]["over_steps"] for r in mine]
                widths = [r["width"] for r in mine]
                ax.plot(widths, values, style, marker="o", color=color, label=f"{label[:3]} {tokens}-token prompt")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["width"] for r in runs}), [str(w) for w in sorted({r["width"] for r in runs})])
        ax.set_xlabel("samples per prompt" if kind == "sample" else "beams")
        ax.set_ylabel("pages saved vs no sharing, over all steps (%)")
        ax.set_title("parallel sampling" if kind == "sample" else "beam search", fontsize=10)
        ax.legend(fontsize=7)
    env = data.get("environment", {})
    add_note(
        fig,
        f"python -m paged_ref.lab.bench sharing: {data.get('model')} ({data.get('mode')} mode), EOS ignored; "
        f"{env.get('cpu') or env.get('gpu')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"{str(env.get('date_utc', ''))[:10]}. (b), (c) counted from the run's tokens; (a) measured.",
    )
    return fig
