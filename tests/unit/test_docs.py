"""The README stays short, the links of README.md and docs/*.md lead somewhere, and docs/configuration.md is what
scripts/config_reference.py makes of include/batch_llm/config/ today."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (a link there is not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _slug(heading: str) -> str:
    # GitHub's heading anchors: lower case, markup and punctuation dropped (but '-' and '_'), spaces to '-'
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(_HTML_ID.findall(text))
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto: ... are not checked


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, over {README_MAX_LINES}: move the detail into "
                                       "a page under docs/ and link it")


def test_readme_links_the_docs_pages():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(ROOT / "README.md") if t.split("#")[0]}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_keeps_what_other_issues_need():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = text.index("## ")
    assert text[first:].startswith("## Two commands"), "the README opens with the two commands"
    assert "make demo" in text and "make test" in text
    for heading in ("## Operating it", "## Stand-ins and limits (said plainly)"):
        assert heading in text
    # include/batch_llm_airflow/lineage.py names README.md#batchllmrunfacet as the run facet's schema URL
    assert "batchllmrunfacet" in _anchors(ROOT / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in _links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading or anchor '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_configuration_reference_is_current():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == module.render(), ("docs/configuration.md is not what include/batch_llm/config/ gives "
                                        f"today; regenerate it: {module.REGENERATE}")


def test_layout_table_lists_every_module_of_the_tree(tmp_path):
    """The user guide's layout table is the tree today: every package and module under include/,
    one line each from its docstring. A module added, moved or removed without the table following fails here."""
    spec = importlib.util.spec_from_file_location("layout_reference", ROOT / "scripts" / "layout_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    table = guide[guide.index(module.BEGIN):guide.index(module.END) + len(module.END)]
    assert table == module.render(), "docs/user-guide.md's layout table is stale: run scripts/layout_reference.py"
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    on_disk = {str(p.relative_to(ROOT / "include")) for pkg in module.PACKAGES
               for p in (ROOT / "include" / pkg).rglob("*.py")
               if p.name not in {"__init__.py", "__main__.py"} and "__pycache__" not in p.parts}
    assert on_disk <= listed, f"modules missing from the layout table: {sorted(on_disk - listed)}"


BENCHMARKS_MAX_LINES = 300


def test_benchmarks_page_holds_todays_figures_and_links_its_history():
    """docs/benchmarks.md stays a page of today's figures: how they were reached and the figures they replace are in
    docs/benchmarks-history.md, which it links."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert text.count("\n") <= BENCHMARKS_MAX_LINES, "move the detail into docs/benchmarks-history.md, by date"
    assert "benchmarks-history.md" in _links(ROOT / "docs" / "benchmarks.md")


def test_every_test_module_opens_with_the_behaviour_it_holds():
    """A test module's first line says what behaviour it holds, not which issue asked for it."""
    opening_with_issue = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        if re.search(r"\bissue\s+#?\d+", first, re.I):
            opening_with_issue.append(f"{path.relative_to(ROOT)}: {first}")
    assert not opening_with_issue, "\n".join(opening_with_issue)


def test_readme_shows_the_run_report_as_a_picture():
    """The README shows what a run leaves behind: a picture of a run report (a PNG under docs/images/)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    pictures = [t for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", _prose(text)) if t.startswith("docs/images/")]
    assert any("report" in t for t in pictures), pictures
    for t in pictures:
        assert (ROOT / t).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", t


def test_every_airflow_import_outside_the_sdk_is_listed_with_its_reason():
    """The provider, the DAGs and the plugin import Airflow through ``airflow.sdk``; each other Airflow module
    they import is in docs/install.md's table of them, with why (a module, or a package ``prefix.*`` of it)."""
    doc = (ROOT / "docs" / "install.md").read_text()
    table = doc.split("### Airflow imports outside `airflow.sdk`", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"`(airflow(?:\.\w+)+)(?:\.\*)?[`.]", table))
    prefixes = set(re.findall(r"`(airflow(?:\.\w+)+)\.\*", table))
    found = set()
    for path in [*(ROOT / "include" / "batch_llm_airflow").rglob("*.py"), *(ROOT / "dags").rglob("*.py"),
                 *(ROOT / "plugins").rglob("*.py")]:
        for module in re.findall(r"^\s*(?:from|import) (airflow(?:\.\w+)*)", path.read_text(), re.M):
            if module != "airflow" and not module.startswith("airflow.sdk"):
                found.add(module)
    assert found, "no Airflow import outside airflow.sdk found: the scan is broken"
    missing = {m for m in found if not any(n == m or n.startswith(m + ".") for n in listed)  # module or its name
               and not any(m.startswith(p + ".") for p in prefixes)}
    assert not missing, f"docs/install.md does not list: {sorted(missing)}"
