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


# ------------------------------------------------------------------ imports of modules named by strings
def test_a_circle_through_importlib_is_found(tmp_path):
    # the shape of the train/backends.py <-> train/distributed.py circle: a registry that loads its
    # implementations by name, which import the registry back
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "registry.py": "import importlib\n\ndef load():\n    return importlib.import_module('pkg.impl')\n",
        "impl.py": "from pkg.registry import load\n",
    })
    found = graph["problems"](pkg)
    assert found[0] == "import circle: pkg.impl -> pkg.registry; pkg.registry -> pkg.impl"
    [dynamic] = graph["dynamic_imports"](pkg)
    assert (dynamic.module, dynamic.line, dynamic.targets, dynamic.guessed) == ("pkg.registry", 4, ("pkg.impl",), False)


def test_a_lazy_module_getattr_through_a_table_of_names_is_seen(tmp_path):
    # the shape of a package's lazy public face: names looked up in a dict, loaded on first use,
    # absolute or relative to the package
    pkg = _package(tmp_path, {
        "__init__.py": """\
            import importlib as il
            _WHERE = {"X": "pkg.low", "Y": ".mid"}

            def __getattr__(name):
                module = _WHERE.get(name)
                return getattr(il.import_module(module, __name__), name)
            """,
        "low.py": "X = 1\n",
        "mid.py": "Y = 2\n",
    })
    graph_, _ = graph["build"](pkg)
    assert graph_["pkg"] == {"pkg.low", "pkg.mid"}


def test___import___and_an_aliased_import_module_are_seen(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "def f():\n    return __import__('pkg.b', fromlist=['x'])\n",
        "b.py": "from importlib import import_module as load\nNAME = 'pkg.c'\nC = load(NAME)\n",
        "c.py": "def g():\n    return __import__('d', globals(), None, ('e',), 1)\n",  # from .d import e
        "d/__init__.py": "",
        "d/e.py": "",
    })
    graph_, _ = graph["build"](pkg)
    assert graph_["pkg.a"] == {"pkg.b"} and graph_["pkg.b"] == {"pkg.c"} and graph_["pkg.c"] == {"pkg.d.e"}


def test_a_plugin_discovery_counts_every_submodule_and_its_circle_is_found(tmp_path):
    # pkgutil discovery (f"{package}.{module.name}"): the computed part stands for any submodule
    files = {
        "__init__.py": "",
        "plugins/__init__.py": """\
            import importlib, pkgutil
            _PACKAGE = __name__.rpartition(".")[0] + ".plugins"

            def discover():
                for module in pkgutil.iter_modules(__path__):
                    importlib.import_module(f"{_PACKAGE}.{module.name}")
            """,
        "plugins/one.py": "X = 1\n",
        "plugins/two.py": "X = 2\n",
    }
    pkg = _package(tmp_path, files)
    assert graph["problems"](pkg) == []
    graph_, _ = graph["build"](pkg)
    assert graph_["pkg.plugins"] == {"pkg.plugins.one", "pkg.plugins.two"}
    (pkg / "plugins" / "two.py").write_text("from pkg.plugins import discover\n")  # a plugin importing its loader
    assert graph["problems"](pkg) == ["import circle: pkg.plugins -> pkg.plugins.two; pkg.plugins.two -> pkg.plugins"]


def test_a_name_read_at_run_time_counts_as_every_module_the_file_names(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/loader.py": """\
            import importlib
            DEFAULT = "pkg.top"

            def load(spec):
                return importlib.import_module(spec.partition(":")[0])
            """,
        "top.py": "from pkg.low.loader import load\n",
    })
    [dynamic] = graph["dynamic_imports"](pkg)
    assert dynamic.guessed and dynamic.targets == ("pkg.top",)
    found = graph["problems"](pkg)
    assert any("runs back up between pkg.low, pkg.top" in line and "pkg.low.loader -> pkg.top" in line for line in found)


def test_an_importlib_import_that_runs_back_up_is_found_and_listed(tmp_path, capsys):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "lib.py": "def __getattr__(name):\n    import importlib\n    return importlib.import_module('pkg.app').f\n",
        "app.py": "from pkg.lib import X\n",
    })
    assert graph["problems"](pkg) == ["import circle: pkg.app -> pkg.lib; pkg.lib -> pkg.app",
                                      "import that runs back up between pkg.app, pkg.lib: pkg.app -> pkg.lib; "
                                      "pkg.lib -> pkg.app"]
    assert graph["main"](["--package-dir", str(pkg), "--dynamic"]) == 0
    assert capsys.readouterr().out == "pkg.lib:3 import_module() -> pkg.app  [read]\n"
