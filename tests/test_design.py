"""docs/DESIGN.md stays true to the code: every module its table names exists, every module of quantize/ is in
the table, and the README points to it."""

import re

from conftest import ROOT


def named_modules() -> list[str]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    table = text[text.index("## Modules"):text.index("\n## ", text.index("## Modules") + 1)]
    return re.findall(r"^\| `([\w/]+\.py)` \|", table, re.MULTILINE)


def test_every_module_of_the_package_is_in_the_design_and_every_module_it_names_exists():
    named = named_modules()
    assert len(named) == len(set(named)), "a module is listed twice"
    have = sorted(str(p.relative_to(ROOT / "quantize")) for p in (ROOT / "quantize").rglob("*.py"))
    assert sorted(set(named) - set(have)) == [], "named in docs/DESIGN.md but not in quantize/"
    assert sorted(set(have) - set(named)) == [], "in quantize/ but not in docs/DESIGN.md's module table"


def test_the_readme_links_the_design():
    assert "(docs/DESIGN.md)" in (ROOT / "README.md").read_text()
