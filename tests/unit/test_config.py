"""Daemon settings: flags > MODELD_* environment > TOML file > defaults."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from modeld.server.config import ConfigError, Settings, default_memory_budget, load_settings

GiB = 1024**3


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    return path


def write_config(tmp_path: Path, text: str, name: str = "modeld.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults(repo):
    settings = load_settings({"model_repository": str(repo)}, environ={})
    assert settings.model_repository == repo
    assert (settings.host, settings.grpc_port, settings.metrics_port) == ("127.0.0.1", 8001, 8002)
    assert settings.lazy_load is True and settings.preload is True
    assert settings.max_message_bytes == 256 * 1024**2
    assert settings.log_format == "json"


def test_default_memory_budget_is_half_of_physical_memory(repo):
    expected = int(psutil.virtual_memory().total * 0.5)
    assert default_memory_budget() == expected
    assert load_settings({"model_repository": str(repo)}, environ={}).memory_budget == expected
    # "0" also means: use the default
    assert load_settings({"model_repository": str(repo), "memory_budget": "0"}, environ={}).memory_budget == expected


def test_memory_budget_sizes_are_parsed(repo):
    assert load_settings({"model_repository": str(repo), "memory_budget": "2GiB"}, environ={}).memory_budget == 2 * GiB
    assert load_settings({"model_repository": str(repo), "memory_budget": "512MB"},
                         environ={}).memory_budget == 512 * 1000**2
    assert load_settings({"model_repository": str(repo), "memory_budget": 12345}, environ={}).memory_budget == 12345


def test_toml_file_sets_values(tmp_path, repo):
    path = write_config(tmp_path, f"""
model_repository = "{repo}"
grpc_port = 9001
memory_budget = "1GiB"
lazy_load = false
log_format = "console"
""")
    settings = load_settings({}, environ={}, config_file=path)
    assert settings.grpc_port == 9001
    assert settings.memory_budget == GiB
    assert settings.lazy_load is False
    assert settings.log_format == "console"
    assert settings.metrics_port == 8002  # untouched default


def test_toml_file_may_use_a_modeld_table(tmp_path, repo):
    path = write_config(tmp_path, f'[modeld]\nmodel_repository = "{repo}"\ngrpc_port = 9100\n')
    assert load_settings({}, environ={}, config_file=path).grpc_port == 9100


def test_precedence_flags_over_env_over_file(tmp_path, repo):
    path = write_config(tmp_path, f"""
model_repository = "{repo}"
grpc_port = 1111
metrics_port = 1112
memory_budget = "1GiB"
host = "file-host"
insecure = true
""")
    environ = {"MODELD_GRPC_PORT": "2221", "MODELD_METRICS_PORT": "2222", "MODELD_HOST": "env-host"}
    flags = {"grpc_port": 3331, "memory_budget": None}  # None: the flag was not given
    settings = load_settings(flags, environ=environ, config_file=path)
    assert settings.grpc_port == 3331  # flag beats env and file
    assert settings.metrics_port == 2222  # env beats file
    assert settings.host == "env-host"
    assert settings.memory_budget == GiB  # file, since the flag is None and env is unset


def test_env_parses_strings(repo):
    environ = {"MODELD_MODEL_REPOSITORY": str(repo), "MODELD_LAZY_LOAD": "off", "MODELD_PRELOAD": "yes",
               "MODELD_MEMORY_BUDGET": "3GiB", "MODELD_SHUTDOWN_GRACE_S": "2.5"}
    settings = load_settings({}, environ=environ)
    assert settings.model_repository == repo
    assert settings.lazy_load is False and settings.preload is True
    assert settings.memory_budget == 3 * GiB
    assert settings.shutdown_grace_s == 2.5


def test_modeld_config_env_names_the_file(tmp_path, repo):
    path = write_config(tmp_path, f'model_repository = "{repo}"\ngrpc_port = 4444\n')
    settings = load_settings({}, environ={"MODELD_CONFIG": str(path)})
    assert settings.grpc_port == 4444


def test_explicit_config_file_wins_over_modeld_config(tmp_path, repo):
    a = write_config(tmp_path, f'model_repository = "{repo}"\ngrpc_port = 1\n', "a.toml")
    b = write_config(tmp_path, f'model_repository = "{repo}"\ngrpc_port = 2\n', "b.toml")
    assert load_settings({}, environ={"MODELD_CONFIG": str(a)}, config_file=b).grpc_port == 2


def test_empty_repository_means_none(repo):
    settings = load_settings({"model_repository": ""}, environ={})
    assert settings.model_repository is None


def test_settings_are_frozen(repo):
    settings = load_settings({"model_repository": str(repo)}, environ={})
    assert isinstance(settings, Settings)
    with pytest.raises(AttributeError):
        settings.grpc_port = 1  # type: ignore[misc]


# -- errors ------------------------------------------------------------------------------


def test_bad_memory_budget_names_setting_value_and_origin(repo):
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(repo), "memory_budget": "lots"}, environ={})
    message = str(info.value)
    assert "memory_budget" in message and "'lots'" in message and "--memory-budget" in message


def test_bad_env_value_names_the_variable(repo):
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(repo)}, environ={"MODELD_MEMORY_BUDGET": "lots"})
    assert "memory_budget" in str(info.value) and "$MODELD_MEMORY_BUDGET" in str(info.value)
    with pytest.raises(ConfigError, match=r"invalid grpc_port 'abc' from \$MODELD_GRPC_PORT"):
        load_settings({"model_repository": str(repo)}, environ={"MODELD_GRPC_PORT": "abc"})
    with pytest.raises(ConfigError, match=r"invalid lazy_load 'maybe' from \$MODELD_LAZY_LOAD"):
        load_settings({"model_repository": str(repo)}, environ={"MODELD_LAZY_LOAD": "maybe"})


def test_bad_file_value_names_the_file(tmp_path, repo):
    path = write_config(tmp_path, f'model_repository = "{repo}"\nmemory_budget = "lots"\n')
    with pytest.raises(ConfigError) as info:
        load_settings({}, environ={}, config_file=path)
    assert "memory_budget" in str(info.value) and str(path) in str(info.value)


def test_unknown_key_in_toml_names_key_and_file(tmp_path, repo):
    path = write_config(tmp_path, f'model_repository = "{repo}"\ngrpc_prot = 9000\n')
    with pytest.raises(ConfigError) as info:
        load_settings({}, environ={}, config_file=path)
    message = str(info.value)
    assert "unknown setting 'grpc_prot'" in message
    assert str(path) in message
    assert "grpc_port" in message  # the known settings are listed


def test_unknown_flag_names_the_flag(repo):
    with pytest.raises(ConfigError, match="unknown setting 'colour' in --colour"):
        load_settings({"model_repository": str(repo), "colour": "blue"}, environ={})


def test_unrelated_env_vars_are_ignored(repo):
    settings = load_settings({"model_repository": str(repo)}, environ={"MODELD_NOT_A_SETTING": "x", "PATH": "/bin"})
    assert settings.grpc_port == 8001


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings({}, environ={}, config_file=tmp_path / "absent.toml")


def test_invalid_toml_file(tmp_path):
    path = write_config(tmp_path, "grpc_port = = 3\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_settings({}, environ={}, config_file=path)


def test_grpc_port_out_of_range_names_the_setting(repo):
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(repo), "grpc_port": 70000}, environ={})
    assert "grpc_port" in str(info.value) and "70000" in str(info.value)


def test_port_bounds(repo):
    assert load_settings({"model_repository": str(repo), "grpc_port": 0, "metrics_port": -1},
                         environ={}).metrics_port == -1
    assert load_settings({"model_repository": str(repo), "grpc_port": 65535}, environ={}).grpc_port == 65535
    with pytest.raises(ConfigError, match="grpc_port -1"):
        load_settings({"model_repository": str(repo), "grpc_port": -1}, environ={})
    with pytest.raises(ConfigError, match="metrics_port -2"):
        load_settings({"model_repository": str(repo), "metrics_port": -2}, environ={})


def test_non_existent_repository_is_refused(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(missing)}, environ={})
    assert str(missing) in str(info.value)
    assert "not a directory" in str(info.value)


def test_other_validations(repo):
    base = {"model_repository": str(repo)}
    with pytest.raises(ConfigError, match="max_message_bytes"):
        load_settings({**base, "max_message_bytes": "100"}, environ={})
    with pytest.raises(ConfigError, match="max_message_bytes"):
        load_settings({**base, "max_message_bytes": "2GiB"}, environ={})
    with pytest.raises(ConfigError, match="must not be negative"):
        load_settings({**base, "drain_delay_s": -1}, environ={})
    with pytest.raises(ConfigError, match="log_format 'xml'"):
        load_settings({**base, "log_format": "xml"}, environ={})


@pytest.mark.parametrize(("flags", "environ", "origin"), [
    ({"grpc_port": 70000}, {}, "--grpc-port"),
    ({}, {"MODELD_GRPC_PORT": "70000"}, "$MODELD_GRPC_PORT"),
])
def test_range_errors_name_the_origin(repo, flags, environ, origin):
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(repo), **flags}, environ=environ)
    assert origin in str(info.value)


def test_non_existent_repository_error_names_setting_and_origin(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_settings({}, environ={"MODELD_MODEL_REPOSITORY": str(tmp_path / "nowhere")})
    assert "model_repository" in str(info.value)
    assert "$MODELD_MODEL_REPOSITORY" in str(info.value)


# -- http_port -------------------------------------------------------------------------


def test_http_port_defaults_to_tritons_8000(repo):
    assert load_settings({"model_repository": str(repo)}, environ={}).http_port == 8000


def test_http_port_from_file_env_and_flag(tmp_path, repo):
    path = write_config(tmp_path, f'model_repository = "{repo}"\nhttp_port = 9000\n')
    assert load_settings({}, environ={}, config_file=path).http_port == 9000
    assert load_settings({}, environ={"MODELD_HTTP_PORT": "9001"}, config_file=path).http_port == 9001
    assert load_settings({"http_port": 9002}, environ={"MODELD_HTTP_PORT": "9001"}, config_file=path).http_port == 9002


def test_http_port_minus_one_turns_http_off_and_zero_picks_a_free_port(repo):
    assert load_settings({"model_repository": str(repo), "http_port": -1}, environ={}).http_port == -1
    assert load_settings({"model_repository": str(repo), "http_port": 0}, environ={}).http_port == 0


@pytest.mark.parametrize(("flags", "environ", "origin"), [
    ({"http_port": -2}, {}, "--http-port"),
    ({}, {"MODELD_HTTP_PORT": "65536"}, "$MODELD_HTTP_PORT"),
])
def test_http_port_out_of_range_names_setting_and_origin(repo, flags, environ, origin):
    with pytest.raises(ConfigError) as info:
        load_settings({"model_repository": str(repo), **flags}, environ=environ)
    assert "http_port" in str(info.value) and "-1 (off)" in str(info.value) and origin in str(info.value)


def test_cli_passes_the_http_port_flag():
    from modeld.server.cli import build_parser

    assert build_parser().parse_args(["serve", "--http-port", "0"]).http_port == 0
    assert build_parser().parse_args(["serve"]).http_port is None  # unset: env, file or default decide
