"""Configuration: defaults, TOML, environment, and clear errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.core.config import RuntimeConfig, load_config
from runtime.core.errors import ConfigError


def test_defaults_need_nothing() -> None:
    config = load_config(env={})
    assert config == RuntimeConfig()
    assert config.snapshot_every == 1 and config.run_dir is None


def test_toml_then_environment(tmp_path: Path) -> None:
    path = tmp_path / "rt.toml"
    path.write_text('[runtime]\nsnapshot_every = 5\nrun_dir = "runs/x"\nhandler_timeout_s = 2.5\n')
    config = load_config(path, env={"ELASTIC_RUNTIME_SNAPSHOT_EVERY": "7", "OTHER": "ignored"})
    assert config.snapshot_every == 7  # the environment wins
    assert config.run_dir == "runs/x" and config.handler_timeout_s == 2.5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ELASTIC_RUNTIME_SNAPSHOT_EVERY": "often"}, r"snapshot_every"),
        ({"ELASTIC_RUNTIME_SNAPSHOT_EVERY": "-1"}, r"`int` >= 0 - at `\$\.snapshot_every`"),
        ({"ELASTIC_RUNTIME_NO_SUCH_FIELD": "1"}, r"no_such_field"),
        ({"ELASTIC_RUNTIME_HANDLER_TIMEOUT_S": "0"}, r"handler_timeout_s"),
    ],
)
def test_bad_values_name_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_unreadable_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(bad, env={})
