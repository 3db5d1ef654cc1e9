"""The import graph's rules (docs/import_graph.py): no circles, imports run down the layers, and
the picture in docs/design.md is the code's."""
import runpy
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
graph = runpy.run_path(str(ROOT / "docs" / "import_graph.py"))


def _package(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_the_package_has_no_circle_and_design_md_shows_its_layers():
    assert graph["problems"](ROOT / "torchrl_oni") == []
    assert graph["main"](["--check"]) == 0


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import f\n",
        "b.py": "def f():\n    from . import a\n",
    })
    found = graph["problems"](pkg)
    assert found and found[0].startswith("import circle: pkg.a -> pkg.b; pkg.b -> pkg.a")


def test_a_package_importing_back_up_is_found_and_layers_are_ordered(tmp_path):
    files = {
        "__init__.py": "",
        "low.py": "X = 1\n",
        "mid/__init__.py": "",
        "mid/one.py": "from pkg.low import X\n",
        "top.py": "from pkg.mid.one import X\n",
    }
    pkg = _package(tmp_path, files)
    assert graph["problems"](pkg) == []
    _, units = graph["build"](pkg)
    assert graph["layers"](units)[:3] == [["pkg", "pkg.low"], ["pkg.mid"], ["pkg.top"]]
    (pkg / "mid" / "two.py").write_text("def g():\n    from pkg.top import X\n")  # runs back up
    found = graph["problems"](pkg)
    assert len(found) == 1 and "runs back up between pkg.mid, pkg.top" in found[0]
    assert "pkg.mid.two -> pkg.top" in found[0]


def test_a_stale_design_md_fails_the_check(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "a.py": "import os\n"})
    design = tmp_path / "design.md"
    design.write_text(f"# notes\n{graph['BEGIN']}\nold\n{graph['END']}\nafter\n")
    args = ["--package-dir", str(pkg), "--design", str(design)]
    assert graph["main"](args + ["--check"]) == 1
    assert graph["main"](args + ["--write"]) == 0
    assert graph["main"](args + ["--check"]) == 0
    assert design.read_text().endswith("after\n") and "pkg.a" not in design.read_text().split("layer 0")[0]
