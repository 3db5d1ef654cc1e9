"""The user's API key stays with the servers the user named on the command line, and a key that
would cross a network in plain http is warned about."""
from torchrl_oni.testing import FakeLLMServer
from torchrl_oni.train import TrainConfig


def test_the_environment_key_does_not_follow_a_url_from_a_file(tmp_path, monkeypatch, capsys):
    """OPENAI_API_KEY goes to an --llm-url given on the command line, not to one read from a
    config file (a planted config.yaml must not collect the user's key)."""
    from torchrl_oni.train.cli import main

    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-own-key")
    with FakeLLMServer(mode="ok") as server:
        config = tmp_path / "planted.yaml"
        config.write_text(f"annotation:\n  llm_url: [{server.url}]\nreward:\n  intrinsic_reward: retrieval\n")
        assert main(["--check-judge", "--config", str(config), "--logdir", str(tmp_path / "a")]) == 0
        assert server.authorization and all(h is None for h in server.authorization), "the key was sent"
        assert "OPENAI_API_KEY is not sent to" in capsys.readouterr().err
        server.authorization.clear()
        assert main(["--check-judge", "--config", str(config), "--llm-url", server.url,
                     "--logdir", str(tmp_path / "b")]) == 0  # named on the command line: the key goes
        assert set(server.authorization) == {"Bearer sk-users-own-key"}


def test_a_key_over_plain_http_off_loopback_is_warned_about():
    from torchrl_oni.train.cli import guard_api_key

    remote = TrainConfig(llm_url=("http://gpu-node:8000/v1",), llm_api_key="k").annotation
    assert any("over plain http" in line for line in guard_api_key(remote, from_command_line=True))
    for url in ("https://gpu-node/v1", "http://127.0.0.1:8000/v1", "http://localhost:8000/v1"):
        assert guard_api_key(TrainConfig(llm_url=(url,), llm_api_key="k").annotation, from_command_line=True) == []
