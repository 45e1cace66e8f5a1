"""docs/DESIGN.md stays true to the code: every module its table names exists, every module of quantize/ is in
the table, and the README points to it."""

import ast
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


def imports() -> dict[str, set[str]]:
    """Each module of quantize/ and the modules of quantize/ it imports, at its top or inside a function."""
    pkg = ROOT / "quantize"
    names = {}
    for p in pkg.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in names.items():
        found = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantize"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("quantize")}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_the_import_graph_has_no_circle_and_the_math_imports_nothing_above_it():
    graph = imports()
    done, path = set(), []

    def visit(m: str) -> None:
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)
    for m, deps in graph.items():
        if m != "quantize.__main__":  # the CLI is the top: only `python -m quantize` imports it
            assert "quantize.cli" not in deps, f"{m} imports the CLI"
        if m.startswith("quantize.quant"):  # pure tensor math: no I/O, no engine; the lean library imports (hf)
            assert all(d.startswith("quantize.quant") or d in ("quantize.hf", "quantize.errors") for d in deps), (m, deps)
