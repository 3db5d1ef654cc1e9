"""The tutorial notebooks: committed with outputs, in sync with their builder, and runnable.

The slow test executes every notebook top to bottom with nbclient in its small setting
(``ONI_TUTORIAL_SMALL=1``) and prints each one's wall time (``pytest -s`` shows it live; it is
also in the captured output of a failure).
"""
import importlib.util
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
EXPECTED = [
    "01_transforms_in_your_pipeline.ipynb",
    "02_annotators.ipynb",
    "03_reward_models.ipynb",
    "04_train_and_plot.ipynb",
]
# notebooks that draw figures from what they ran
WITH_FIGURES = {"01_transforms_in_your_pipeline.ipynb", "02_annotators.ipynb",
                "03_reward_models.ipynb", "04_train_and_plot.ipynb"}


def _notebooks():
    return sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.ipynb"))


def _read(name):
    return nbformat.read(TUTORIALS / name, as_version=4)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb, kind):
    return [o for c in _code_cells(nb) for o in c.get("outputs", []) if o.get("output_type") == kind]


def _images(nb):
    return [o for c in _code_cells(nb) for o in c.get("outputs", [])
            if "data" in o and "image/png" in o["data"]]


def test_all_tutorials_are_there():
    assert _notebooks() == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_committed_with_outputs_and_no_errors(name):
    nb = _read(name)
    cells = _code_cells(nb)
    assert cells and all(c.execution_count for c in cells), "run it: tutorials/build_notebooks.py --execute"
    assert not _outputs(nb, "error")
    if name in WITH_FIGURES:
        assert _images(nb), f"{name} should be saved with its figures"


@pytest.mark.parametrize("name", EXPECTED)
def test_one_marked_scale_cell_reads_the_small_switch(name):
    cells = _code_cells(_read(name))
    scale = [c for c in cells if "SCALE: the only cell to edit" in c.source]
    assert len(scale) == 1
    assert "ONI_TUTORIAL_SMALL" in scale[0].source and "SMALL" in scale[0].source
    assert cells.index(scale[0]) == 0, "the scale cell must be the first code cell"
    others = "\n".join(c.source for c in cells if c is not scale[0])
    assert "ONI_TUTORIAL_SMALL" not in others


def test_notebooks_match_their_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", TUTORIALS / "build_notebooks.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert sorted(builder.NOTEBOOKS) == EXPECTED
    for name in EXPECTED:
        built = [(c.cell_type, c.source) for c in builder.build(name).cells]
        saved = [(c.cell_type, c.source) for c in _read(name).cells]
        assert built == saved, f"{name} differs from tutorials/build_notebooks.py: rebuild it"


def _kernel_or_skip():
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        pytest.skip("no 'python3' Jupyter kernel: python -m ipykernel install --user")


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch, capsys):
    _kernel_or_skip()
    from nbclient import NotebookClient

    if name.startswith("02_"):
        # serves the small test model: needs the embedded extra and its weights package
        pytest.importorskip("transformers")
        from torchrl_oni.serve.models import TEST_MODEL, is_installed

        if not is_installed(TEST_MODEL):
            pytest.skip(f"{TEST_MODEL} is not installed (see README: the model packages)")
    monkeypatch.setenv("ONI_TUTORIAL_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = _read(name)
    for cell in _code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
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
        assert (runs / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
