"""Configuration: defaults, TOML, environment, and clear errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from elastic_runtime.cli.controller import config_from_args as controller_from_args
from elastic_runtime.cli.launch import config_from_args as launch_from_args
from elastic_runtime.cli.main import build_parser, main
from elastic_runtime.cluster.config import LaunchConfig, Strategy
from elastic_runtime.core.config import RuntimeConfig, convert_config, load_config
from elastic_runtime.core.errors import ConfigError


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
        ({"ELASTIC_RUNTIME_MAX_RECOVERIES": "3"}, r"^environment: max_recoveries is now called max_failures$"),
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


# --- LaunchConfig (runtime/cluster/config.py): the multi-process run's settings, checked the same way -------


def launch_config(**overrides: Any) -> LaunchConfig:
    return LaunchConfig(**({"command": ["python", "train.py"], "nprocs": 4} | overrides))


def test_launch_config_defaults_construct_and_stand_for_the_group() -> None:
    config = launch_config()
    assert (config.min_nprocs, config.slices, config.slice_size, config.spares) == (4, 4, 1, 1)
    assert config.strategy is Strategy.REFORM and config.spawn_timeout_s == 60.0
    assert launch_config(command=[]).spares == 0  # the service mode starts no spare
    assert launch_config(strategy="restart").strategy is Strategy.RESTART


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"spawn_timeout_s": 0}, r"spawn_timeout_s=0 is out of range \(must be > 0\)"),
        ({"hang_timeout_s": -1.0}, r"hang_timeout_s=-1.0 is out of range"),
        ({"heartbeat_timeout_s": 0.0}, r"heartbeat_timeout_s=0.0 is out of range"),
        ({"heartbeat_interval_s": 1.0}, r"heartbeat_interval_s=1 must be shorter than heartbeat_timeout_s=0.8"),
        ({"start_timeout_s": -5}, r"start_timeout_s=-5"),
        ({"drain_timeout_s": -1}, r"drain_timeout_s=-1 is out of range \(must be >= 0\)"),
        ({"nprocs": 0}, r"nprocs=0 is out of range \(must be >= 1\)"),
        ({"spares": -1}, r"spares=-1 is out of range"),
        ({"durable_every": 0}, r"durable_every=0 is out of range"),
        ({"listen_port": 70000}, r"listen_port=70000 is out of range \(must be <= 65535\)"),
        ({"nprocs": "4"}, r"nprocs='4' is not a number"),
        ({"min_nprocs": 5}, r"min_nprocs=5 must be <= nprocs=4"),
        ({"min_nprocs": 0}, r"min_nprocs=0 is out of range"),
        ({"slices": 3}, r"slices=3 must divide nprocs=4"),
        ({"slices": 2, "min_nprocs": 3}, r"min_nprocs=3 must be whole slices of 2 processes"),
        ({"neighbour_replicas": True}, r"neighbour_replicas needs slices of 2 processes or more"),
        ({"strategy": "start"}, r"strategy='start' must be one of reform, restart"),
        ({"coordinator_ports": (9000, 8000)}, r"coordinator_ports=9000-8000"),
        ({"maintenance_subscription": "sub"}, r"maintenance_subscription must look like projects/P"),
    ],
)
def test_launch_config_bad_values_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^launch config: .*" + message):
        launch_config(**overrides)


def test_launch_config_from_values_names_an_unknown_field_or_a_bad_value() -> None:
    values = {"command": ["python", "train.py"], "nprocs": "4", "spawn_timeout_s": "2.5"}
    assert convert_config(LaunchConfig, values).spawn_timeout_s == 2.5  # strings converted, as from a file
    with pytest.raises(ConfigError, match=r"unknown field `no_such_field`"):
        convert_config(LaunchConfig, values | {"no_such_field": 1})
    with pytest.raises(ConfigError, match=r"^launch config: min_nprocs=5 must be <= nprocs=4$"):
        convert_config(LaunchConfig, values | {"min_nprocs": "5"}, origin="launch config")
    with pytest.raises(ConfigError, match=r"form_timeout_s"):
        convert_config(LaunchConfig, values | {"form_timeout_s": "0"})


def test_launch_config_is_frozen_and_a_replaced_one_is_checked_again() -> None:
    config = launch_config(secret="s3cret-value")
    with pytest.raises(AttributeError):
        config.nprocs = 8  # type: ignore[misc]
    assert msgspec.structs.replace(config, nprocs=8).nprocs == 8
    with pytest.raises(ConfigError, match=r"min_nprocs=4 must be <= nprocs=2"):
        msgspec.structs.replace(config, nprocs=2)  # min_nprocs was settled at 4
    assert "s3cret-value" not in repr(config) and "nprocs=4" in repr(config)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "--nprocs", "2", "--spawn-timeout", "0", "--", "true"], "spawn_timeout_s=0.0 is out of range"),
        (["launch", "--nprocs", "2", "--min-nprocs", "3", "--", "true"], "min_nprocs=3 must be <= nprocs=2"),
        (["controller", "--listen", "127.0.0.1:0", "--nprocs", "0"], "nprocs=0 is out of range"),
    ],
)
def test_the_cli_says_which_value_is_bad(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_RUNTIME_TOKEN", "s" * 64)  # the controller command reads the secret
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_cli_takes_its_defaults_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option left out is the config's default, not a second copy of it in the parser."""
    monkeypatch.setenv("ELASTIC_RUNTIME_TOKEN", "s" * 64)
    parser = build_parser()
    launched = launch_from_args(parser.parse_args(["launch", "--nprocs", "2", "--", "python", "train.py"]))
    assert launched == LaunchConfig(command=["python", "train.py"], nprocs=2)
    served = controller_from_args(parser.parse_args(["controller", "--listen", "127.0.0.1:7000", "--nprocs", "2"]))
    own = {"command": [], "secret": "s" * 64, "listen_port": 7000}
    assert served == LaunchConfig(nprocs=2, **own)


def test_under_launch_every_field_a_script_sets_applies_or_is_announced() -> None:
    # Nothing ignored without a word: a field a worker does not apply itself is sent in Hello.settings, and the
    # controller says what sets it for the group, or why it has no effect there (ConfigOverridden).
    from elastic_runtime.cluster.controller.admission import OVERRIDDEN
    from elastic_runtime.defaults.elastic import APPLIED_IN_WORKERS, launch_owned

    special = {"run_dir"}  # the launch's run folder: the same one is fine, another one is refused
    fields = set(RuntimeConfig.__struct_fields__)
    assert fields - APPLIED_IN_WORKERS - special == set(OVERRIDDEN) - {"mesh_policy"}
    config = RuntimeConfig(max_failures=7, scale_up_poll_s=None, fingerprint_every=1, handler_timeout_s=9.0)
    sent = launch_owned(config, None, resume=False)
    assert sent == {"max_failures": "7", "scale_up_poll_s": "None"}  # the applied ones stay in the worker
    assert OVERRIDDEN["max_failures"] == "--max-failures sets the group's failure budget"
