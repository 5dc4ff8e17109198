"""The one-day course: the core path adds up, each notebook's header agrees with the README, the
sections are numbered once, and the README's teaching claims agree with the data they describe."""

import json
import re
from collections import Counter
from pathlib import Path

import nbformat
from check_mutants import MUTANTS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
HEADER = re.compile(r"> \*\*One-day course:\*\* core, about (\d+) min: .*?Optional(?:, about (\d+) min)?: ")
# notebooks that carry the header (03, 08 and 09 get theirs where they are maintained)
WITH_HEADER = [
    "01_kv_cache_memory",
    "02_allocator_and_block_tables",
    "03_fragmentation",
    "04_flexattention_paged",
    "05_triton_decode_kernel",
    "06_latency_scaling",
    "07_paged_eviction",
    "08_end_to_end",
    "09_serving",
    "exercises/ex1_allocator_and_slots",
    "exercises/ex2_paged_attention",
    "exercises/ex3_eviction_scores",
    "exercises/ex4_eviction_policy",
]


DAY_TWO_HEADER = re.compile(r"> \*\*Two-day course, day two:\*\* core, about (\d+) min: ")


def _core_table(start: str = "## A one-day core path", end: str = "### Day two") -> dict[str, int]:
    """README's core path: notebook path (no suffix) -> core minutes."""
    block = README[README.index(start) : README.index(end)]
    rows = re.findall(r"^\| \[[^\]]+\]\(notebooks/([^)]+)\.ipynb\)[^|]*\| (\d+) min \|", block, re.M)
    return {name: int(minutes) for name, minutes in rows}


def _header(name: str):
    cell = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0].source
    return HEADER.search(cell)


def test_the_core_path_fits_in_a_day_and_matches_each_notebook():
    table = _core_table()
    total = re.search(r"\*\*total\*\* \| \*\*(\d+) min = (\d+) h(?: (\d+) min)?\*\*", README)
    assert total and int(total[1]) == sum(table.values()) == 60 * int(total[2]) + int(total[3] or 0)
    assert sum(table.values()) <= 8 * 60
    for name in WITH_HEADER:
        found = _header(name)
        assert found, f"{name}: no one-day course header"
        assert int(found[1]) == table[name], (name, found[1], table[name])
    for name in table:  # every notebook of the path exists; any header it has agrees
        assert (ROOT / "notebooks" / f"{name}.ipynb").exists(), name
        found = _header(name)
        assert found is None or int(found[1]) == table[name], name


def test_day_two_adds_up_and_matches_each_exercise():
    """Exercises 5-8 and notebooks 10-11 make a second day; each exercise's header agrees with the table."""
    table = _core_table("### Day two", "## Teaching with it")
    assert set(table) >= {
        "exercises/ex5_scheduler",
        "exercises/ex6_prefix_cache",
        "exercises/ex7_reading_fewer_pages",
        "exercises/ex8_fewer_bytes",
    }
    total = re.search(r"\*\*total, day two\*\* \| \*\*(\d+) min = (\d+) h(?: (\d+) min)?\*\*", README)
    assert total and int(total[1]) == sum(table.values()) == 60 * int(total[2]) + int(total[3] or 0)
    assert sum(table.values()) <= 8 * 60
    for name, minutes in table.items():
        assert (ROOT / "notebooks" / f"{name}.ipynb").exists(), name
        found = DAY_TWO_HEADER.search(nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0].source)
        assert found and int(found[1]) == minutes, name
    assert "#day-two-serving-prefix-caching-reading-fewer-pages" in (
        nbformat.read(ROOT / "notebooks" / "exercises" / "ex5_scheduler.ipynb", as_version=4).cells[0].source
    )


def test_graduate_sections_are_marked_optional():
    for name, heading in [
        ("04_flexattention_paged", "## Aside (torch 2.13.0)"),
        ("05_triton_decode_kernel", "## 7. What the compiler made of the kernel"),
        ("07_paged_eviction", "## 7. The evaluation"),
        ("07_paged_eviction", "## 8. The reviewers' ablation"),
        ("07_paged_eviction", "## 9. The K/V swap"),
    ]:
        cells = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells
        line = next(line for c in cells for line in c.source.splitlines() if line.startswith(heading))
        assert "optional, graduate" in line, (name, line)


def test_sections_are_numbered_once_and_the_contents_list_agrees():
    for path in sorted((ROOT / "notebooks").glob("0[1-7]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        numbers = [
            int(m[1]) for c in cells if c.cell_type == "markdown" for m in re.finditer(r"^## (\d+)[.·]", c.source, re.M)
        ]
        assert numbers == list(range(1, len(numbers) + 1)), (path.name, numbers)
    intro = nbformat.read(ROOT / "notebooks" / "05_triton_decode_kernel.ipynb", as_version=4).cells
    items = re.findall(r"^(\d+)\. \*\*([^*]+)\*\*", intro[0].source, re.M)
    headings = {int(m[1]): m[2] for c in intro for m in re.finditer(r"^## (\d+)\. (.*)$", c.source, re.M)}
    assert [int(n) for n, _ in items] == sorted(headings)[: len(items)]
    for n, words in items:  # the list names each section by a word of its heading
        assert any(w.lower() in headings[int(n)].lower() for w in re.findall(r"[A-Za-z-]{3,}", words)), (n, words)


def test_the_readme_programs_per_sm_claim_is_the_json():
    report = json.loads((ROOT / "figures" / "data" / "kernels.json").read_text())
    counts = {90: Counter(), 80: Counter()}
    for e in report["split_kernel"]:
        if e["hints"] and e["dtype"] in ("fp16", "bf16") and e["arch"] in counts:
            counts[e["arch"]][e["programs_per_sm"]] += 1
    total = {arch: sum(c.values()) for arch, c in counts.items()}
    assert total == {90: 256, 80: 256}
    sm90, sm80 = counts[90], counts[80]
    claim = (
        f"{' or '.join(map(str, sorted(sm90)))} programs per SM on sm_90 ({max(sm90)} in {sm90[max(sm90)]} of the "
        f"{total[90]}) and {' or '.join(map(str, sorted(sm80)))} on sm_80 ({min(sm80)} in {sm80[min(sm80)]} of the "
        f"{total[80]})"
    )
    assert claim in README, claim


def test_the_readme_counts_the_mutants():
    assert f"`tests/check_mutants.py`: {sum(len(m) for m in MUTANTS.values())} of\nthem" in README


def _cells(name: str) -> list:
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells


def test_notebook_09_core_defines_its_words_before_the_optional_sections():
    """Section 1 (core) defines TTFT, TPOT, the reservations and the watermark, which section 4 (core)
    uses; sections 2 and 3 are optional."""
    cells = _cells("09_serving")
    optional = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and "## 2 ·" in c.source)
    section1 = " ".join(c.source for c in cells[:optional] if c.cell_type == "markdown")
    for word in ("**TTFT**", "**TPOT**", "**Reservation**", "**Watermark**"):
        assert word in section1, word


def test_notebook_08_lists_only_core_sections_as_its_core_checks():
    intro = _cells("08_end_to_end")[0].source
    core, optional = intro.split("The optional sections")
    core_sections = {int(n) for m in re.findall(r"\(sections? ([\d and]+)\)", core) for n in re.findall(r"\d", m)}
    optional_sections = {int(n) for n in re.findall(r"\(section (\d)\)", optional)}
    assert core_sections and max(core_sections) <= 4, core_sections
    assert optional_sections and min(optional_sections) >= 5, optional_sections


def test_notebook_08_sends_preemption_to_notebook_09():
    for c in _cells("08_end_to_end"):
        if c.cell_type == "markdown" and "preempt" in c.source:
            assert "09" in c.source, c.source[:200]


def test_the_notebooks_point_to_their_exercises():
    """Each notebook from 02 to 08 links to an exercise that exists (09 and 10 link to theirs where they are
    maintained, 11 to exercise 8); 08's link is exercise 6, where shared pages and the prefix cache are taught."""
    for path in sorted((ROOT / "notebooks").glob("[01][0-9]_*.ipynb"))[1:]:  # 02 to 11
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        links = re.findall(r"\]\((exercises/ex\d_[a-z_]+\.ipynb)\)", text)
        assert links, f"{path.name} points to no exercise"
        for link in links:
            assert (ROOT / "notebooks" / link).exists(), (path.name, link)
    assert "exercises/ex6_prefix_cache.ipynb" in "\n".join(c.source for c in _cells("08_end_to_end"))
    pointers = {"09_serving": ["ex5_scheduler", "ex6_prefix_cache"], "10_reading_fewer_pages": ["ex7_"]}
    pointers["11_fewer_bytes_per_token"] = ["ex8_"]
    for name, exercises in pointers.items():
        text = "\n".join(c.source for c in _cells(name))
        assert all(f"exercises/{ex}" in text for ex in exercises), name
