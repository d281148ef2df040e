"""The README is a user's manual: short, the first command near the top, every performance figure
from the generated results table, and every doc it points to present."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN = "<!-- results-table:"
END = "<!-- results-table end -->"
# a measured figure: a number with a unit of time, rate, bandwidth or a percentage, or a speed-up
FIGURE = re.compile(r"\d[\d,.]*\s*(?:(?:output\s+)?(?:ms|us|µs|tok/s|GB/s|TB/s|%)(?![\w/])|x\b)")


def outside_table(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + rest.split(END, 1)[1]


def test_readme_is_short_with_make_run_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: move detail to docs/)"
    first = next(i for i, line in enumerate(lines) if "make run" in line)
    assert first < 40, f"`make run` first appears on line {first + 1} (within the first 40)"


def test_readme_figures_come_from_the_generated_table():
    stray = [m.group(0) for m in FIGURE.finditer(outside_table(README.read_text()))]
    assert stray == [], f"figures outside the generated results table: {stray}"


def test_figure_pattern_catches_a_dated_paragraph():
    assert FIGURE.search("batch-1 decode at 2.93 ms per output token (65 %)")
    assert FIGURE.search("4,000 output tok/s offline")
    assert FIGURE.search("9,780 tok/s against 5,411: 1.81x")
    assert not FIGURE.search("qwen3-4b's 36 layers, --max-tokens 16, sm_90")


def test_docs_it_names_exist():
    text = README.read_text()
    named = set(re.findall(r"\b((?:docs|bench|tools|tests)/[\w./-]+\.(?:md|py|csv|sh|json))", text))
    named |= {"CHANGELOG.md"} if "CHANGELOG.md" in text else set()
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert named and missing == [], f"README.md names files that do not exist: {missing}"
