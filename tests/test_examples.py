"""The shipped cluster script carries no working secret: without the user's own it stops first."""
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "cluster" / "plain_nodes.sh"


def _run(env, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_cluster_script_refuses_to_run_without_secrets():
    env = {k: v for k, v in os.environ.items() if k not in ("ONI_SERVE_API_KEY", "RAY_AUTH_TOKEN")}
    done = _run(env, "head")
    assert done.returncode != 0 and "set ONI_SERVE_API_KEY to a secret" in done.stderr
    done = _run(dict(env, ONI_SERVE_API_KEY="s3cret"), "head")
    assert done.returncode != 0 and "set RAY_AUTH_TOKEN to a secret" in done.stderr
    assert "change-me" not in SCRIPT.read_text()


def test_with_secrets_it_reaches_its_commands():
    done = _run(dict(os.environ, ONI_SERVE_API_KEY="a", RAY_AUTH_TOKEN="b"), "nothing")
    assert done.returncode == 2 and done.stderr.startswith("usage:")
