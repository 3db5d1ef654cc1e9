"""The tutorials: percent-format sources that parse into the expected notebooks, and that run.

The sources are ``tutorials/NN_*.py`` (jupytext "percent" format); ``tutorials/build.py`` turns
them into notebooks. The fast tests check the sources' shape (title, one tagged scale cell,
valid Python, canonical jupytext text) and the builder's command line. The slow test converts
each source with jupytext and executes it with nbclient in a temporary folder in its small
setting (``ONI_TUTORIAL_SMALL=1``), and prints each one's wall time (``pytest -s`` shows it live;
it is also in the captured output of a failure). Another slow test runs each source as a plain
script (``python NN_*.py``), as a reader who does not open Jupyter does, at the smallest sizes its
code takes (``SCRIPT_SIZES``: its scale cell edited as a reader edits it).
"""
import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
EXPECTED = [
    "01_transforms_in_your_pipeline",
    "02_annotators",
    "03_reward_models",
    "04_train_and_plot",
]
# tutorials that draw figures from what they ran
WITH_FIGURES = {"01_transforms_in_your_pipeline", "02_annotators", "03_reward_models", "04_train_and_plot"}
SCALE_MARK = "SCALE: the only cell to edit"
# The plain-script run checks what running the file as a script changes (its worker processes
# import it again; nothing is shown inline), not what the sizes show, which the notebook run
# checks at the small setting: it runs a copy whose scale cell sets these sizes instead.
SCRIPT_SIZES = {
    "01_transforms_in_your_pipeline": {"STEPS": "100", "NUM_ENVS": "2", "FRAMES": "512"},
    "02_annotators": {},  # its small setting is its smallest: one tagged caption, the packaged test model
    "03_reward_models": {"NUM_ENVS": "8", "STEPS": "300", "CLS_STEPS": "20", "RANK_STEPS": "20", "PAIRS": "300",
                         "ELLM_STEPS": "100"},
    "04_train_and_plot": {"FRAMES": "2048"},
}
# the header and cell metadata tutorials/jupytext.toml keeps
JUPYTEXT_FILTERS = {"notebook_metadata_filter": "kernelspec,-all", "cell_metadata_filter": "tags,-all"}


def _builder():
    spec = importlib.util.spec_from_file_location("tutorials_build", TUTORIALS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source(name):
    return TUTORIALS / f"{name}.py"


def _scale_cell(text):
    """The scale cell's text: from its SCALE mark to the next cell."""
    start = text.index(SCALE_MARK)
    return text[start:text.index("# %%", start)]


def _with_sizes(text, sizes):
    """The tutorial's source with the scale cell's ``NAME = ...`` lines set to ``sizes``."""
    cell = _scale_cell(text)
    edited = cell
    for name, value in sizes.items():
        edited, count = re.subn(rf"^{name} = .*$", f"{name} = {value}", edited, flags=re.M)
        assert count == 1, f"the scale cell has no single '{name} = ...' line"
    return text.replace(cell, edited)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb, kind):
    return [o for c in _code_cells(nb) for o in c.get("outputs", []) if o.get("output_type") == kind]


def _images(nb):
    return [o for c in _code_cells(nb) for o in c.get("outputs", [])
            if "data" in o and "image/png" in o["data"]]


def test_all_tutorials_are_there_and_no_notebooks_are_committed():
    assert [p.stem for p in _builder().sources()] == EXPECTED
    assert not list(TUTORIALS.glob("*.ipynb")), "notebooks are built, not committed: tutorials/build.py"


@pytest.mark.parametrize("name", EXPECTED)
def test_source_parses_into_the_expected_notebook(name):
    nb = jupytext.read(_source(name))
    nbformat.validate(nb)
    first = nb.cells[0]
    number = name[:2]
    assert first.cell_type == "markdown"
    assert re.match(rf"# {number} · \S", first.source), "the first cell is the title: '# NN · ...'"
    code = _code_cells(nb)
    assert len(code) >= 4 and sum(c.cell_type == "markdown" for c in nb.cells) >= 4
    for cell in code:
        ast.parse(cell.source)  # plain Python: no magics, nothing jupytext would comment out


@pytest.mark.parametrize("name", EXPECTED)
def test_one_tagged_scale_cell_reads_the_small_switch(name):
    code = _code_cells(jupytext.read(_source(name)))
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    marked = [c for c in code if SCALE_MARK in c.source]
    assert len(tagged) == 1 and marked == tagged, "one scale cell, marked and tagged 'parameters'"
    scale = tagged[0]
    assert code.index(scale) == 0, "the scale cell must be the first code cell"
    assert re.search(r"^SMALL = .*ONI_TUTORIAL_SMALL", scale.source, re.M)
    others = "\n".join(c.source for c in code if c is not scale)
    assert "ONI_TUTORIAL_SMALL" not in others


@pytest.mark.parametrize("name", EXPECTED)
def test_the_script_sizes_edit_the_scale_cell_only(name):
    text = _source(name).read_text(encoding="utf-8")
    edited = _with_sizes(text, SCRIPT_SIZES[name])
    ast.parse(edited)
    assert (_scale_cell(edited) != _scale_cell(text)) == bool(SCRIPT_SIZES[name])
    assert edited.replace(_scale_cell(edited), "") == text.replace(_scale_cell(text), "")


@pytest.mark.parametrize("name", EXPECTED)
def test_source_is_canonical_jupytext(name):
    # What jupytext (CLI, or Jupyter's extension, with tutorials/jupytext.toml) would write back:
    # a source in this form round-trips through Jupyter without a diff.
    text = _source(name).read_text(encoding="utf-8")
    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata.setdefault("jupytext", {}).update(JUPYTEXT_FILTERS)
    assert jupytext.writes(nb, fmt="py:percent") == text, f"normalise it: jupytext --to py:percent {name}.py"


def test_jupytext_config_matches_the_filters_checked_here():
    from jupytext.config import load_jupytext_configuration_file

    config = load_jupytext_configuration_file(str(TUTORIALS / "jupytext.toml"))
    assert {k: getattr(config, k) for k in JUPYTEXT_FILTERS} == JUPYTEXT_FILTERS


def test_builder_writes_unexecuted_notebooks(tmp_path, capsys):
    build = _builder()
    assert build.main(["02", "04_train_and_plot", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["02_annotators.ipynb", "04_train_and_plot.ipynb"]
    nb = nbformat.read(tmp_path / "04_train_and_plot.ipynb", as_version=4)
    nbformat.validate(nb)
    src = jupytext.read(_source("04_train_and_plot"))
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in src.cells]
    assert nb.metadata.kernelspec.name == "python3" and "jupytext" not in nb.metadata
    assert not _outputs(nb, "stream") and not any(c.execution_count for c in _code_cells(nb))


@pytest.mark.parametrize("argv, message", [
    (["99"], "unknown tutorial '99'"),
    (["--full"], "--full needs --execute"),
    (["--execute", "--timeout", "0"], "--timeout must be positive"),
])
def test_builder_rejects_bad_arguments_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _builder().main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("build.py: error: ") and message in err[-1]
    assert not list(tmp_path.iterdir())


def _kernel_or_skip():
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        pytest.skip("no 'python3' Jupyter kernel: python -m ipykernel install --user")


def _model_or_skip(name):
    if name.startswith("02_"):
        # serves the small test model: needs the embedded extra and its weights package
        pytest.importorskip("transformers")
        from torchrl_oni.serve.models import TEST_MODEL, is_installed

        if not is_installed(TEST_MODEL):
            pytest.skip(f"{TEST_MODEL} is not installed (see README: the model packages)")


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_tutorial_runs_top_to_bottom(name, tmp_path, capsys):
    _kernel_or_skip()
    _model_or_skip(name)
    build = _builder()
    nb = build.to_notebook(_source(name))
    seconds = build.execute(nb, tmp_path, small=True, timeout=600)
    with capsys.disabled():
        print(f"\n[tutorial] {name}: {seconds:.1f} s")
    assert all(c.execution_count for c in _code_cells(nb))
    assert not _outputs(nb, "error")
    if name in WITH_FIGURES:
        assert _images(nb), f"{name} drew no figure"
    if name.startswith("04_"):
        runs = tmp_path / "runs" / "tutorial04"
        assert (runs / "none" / "metrics.csv").is_file()
        assert (runs / "retrieval" / "metrics.csv").is_file()
        assert "intrinsic_reward: retrieval" in (runs / "retrieval" / "config.yaml").read_text()
        assert (runs / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_tutorial_runs_as_a_plain_script(name, tmp_path, capsys):
    # `python tutorials/NN_....py`, as a reader runs a .py file: worker processes started with
    # "spawn" import the script again, so a tutorial that starts any must not re-run itself in them
    # (01 died with a bare EOFError after printing everything three times)
    _model_or_skip(name)
    script = tmp_path / f"{name}.py"
    script.write_text(_with_sizes(_source(name).read_text(encoding="utf-8"), SCRIPT_SIZES[name]), encoding="utf-8")
    env = dict(os.environ, ONI_TUTORIAL_SMALL="1", MPLBACKEND="Agg")  # Agg: no window to wait on
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path, env=env)
    with capsys.disabled():
        print(f"\n[tutorial as a script] {name}: {time.perf_counter() - start:.1f} s")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines and out.stdout.count(lines[0]) == 1, "the script ran more than once (its worker processes re-ran it)"
