"""Every Python file of the repository compiles without a warning.

Python 3.12 prints a ``SyntaxWarning`` at import for an invalid escape sequence in a string
(3.11 a silent ``DeprecationWarning``; a later Python will refuse it): a docstring's ``\\ ``
reached users' consoles from ``rewards/ellm/conditioning.py`` on the GPU node's Python 3.12.
"""
import subprocess
import warnings
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def _python_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an sdist): every .py under the tree
        return sorted(p for p in ROOT.rglob("*.py") if ".git" not in p.parts)
    return [ROOT / name for name in listed.stdout.split()]


def _compile_warnings(source: str, name: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile(source, name, "exec")
    return [f"{name}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]


def test_an_invalid_escape_is_caught():
    assert _compile_warnings('"""close`\\ d"""\n', "crafted.py")


def test_every_python_file_compiles_without_a_warning():
    files = _python_files()
    assert len(files) > 50  # the repository's files were found
    found = [msg for path in files
             for msg in _compile_warnings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == []
