"""iris.config: size parsing and ContextConfig resolution (argument > environment > default)."""

from __future__ import annotations

import logging

import attrs
import pytest

import iris
from iris.config import DEFAULT_HEAP_SIZE, ContextConfig, parse_size

pytestmark = pytest.mark.usefixtures("clean_iris_env", "no_on_timeout_env")


@pytest.fixture
def no_on_timeout_env(monkeypatch):
    """IRIS_ON_TIMEOUT removed for the test (``clean_iris_env`` predates it)."""
    monkeypatch.delenv("IRIS_ON_TIMEOUT", raising=False)


# -- parse_size ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1GiB", 1 << 30),
        ("512MiB", 512 << 20),
        ("512 MiB", 512 << 20),
        ("2G", 2 << 30),
        ("4M", 4 << 20),
        ("64kib", 64 << 10),
        ("  64 KiB  ", 64 << 10),
        ("1.5GiB", 3 << 29),
        ("1TiB", 1 << 40),
        ("1GB", 10**9),
        ("3MB", 3 * 10**6),
        ("8KB", 8000),
        ("2TB", 2 * 10**12),
        ("1e9", 10**9),
        ("4096", 4096),
        ("4096B", 4096),
    ],
)
def test_parse_size_strings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", [1, 4096, 1 << 40])
def test_parse_size_ints_pass_through(value):
    assert parse_size(value) == value


@pytest.mark.parametrize("text", ["lots", "", "GiB", "1XB", "1 Gibibyte", "12 34", "nan", "1e3MiB"])
def test_parse_size_bad_string_is_value_error_with_help(text):
    with pytest.raises(ValueError) as excinfo:
        parse_size(text)
    message = str(excinfo.value)
    assert repr(text) in message  # names the bad value
    assert "GiB" in message  # and shows the accepted form


@pytest.mark.parametrize("text", ["inf", "1e999"])
def test_parse_size_infinite_is_value_error(text):
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size(text)


@pytest.mark.parametrize("value", [True, False])
def test_parse_size_bool_is_type_error(value):
    with pytest.raises(TypeError, match="int or a string"):
        parse_size(value)


@pytest.mark.parametrize("value", [1.5, None, b"1GiB", [1]])
def test_parse_size_other_types_are_type_error(value):
    with pytest.raises(TypeError):
        parse_size(value)


@pytest.mark.parametrize("value", [0, -1, -(1 << 30), "0", "0GiB", "-5", "0.5"])
def test_parse_size_zero_or_negative_is_value_error(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_parse_size_negative_message_says_positive():
    with pytest.raises(ValueError, match="positive.*-1"):
        parse_size(-1)


# -- ContextConfig ------------------------------------------------------------------------------


def test_defaults():
    config = ContextConfig.from_env()
    assert config.backend == "triton"
    assert config.device == "cpu"
    assert config.heap_size == DEFAULT_HEAP_SIZE["cpu"] == 128 << 20
    assert config.heap_provider is None
    assert config.debug is False
    assert config.log_level is None
    assert config.timeout == 300.0
    assert config.on_timeout == "raise"


def test_default_heap_size_depends_on_device():
    assert ContextConfig.from_env(device="cuda").heap_size == 1 << 30
    assert ContextConfig.from_env(device="cpu").heap_size == 128 << 20


def test_backend_precedence(monkeypatch):
    assert ContextConfig.from_env().backend == "triton"
    monkeypatch.setenv("IRIS_BACKEND", "gluon")
    assert ContextConfig.from_env().backend == "gluon"
    assert ContextConfig.from_env(backend=None).backend == "gluon"  # None means "not given"
    assert ContextConfig.from_env(backend="echo").backend == "echo"


def test_heap_size_precedence(monkeypatch):
    monkeypatch.setenv("IRIS_HEAP_SIZE", "64MiB")
    assert ContextConfig.from_env().heap_size == 64 << 20
    assert ContextConfig.from_env(heap_size="4MiB").heap_size == 4 << 20
    assert ContextConfig.from_env(heap_size=8192).heap_size == 8192


def test_heap_size_from_env_is_validated(monkeypatch):
    monkeypatch.setenv("IRIS_HEAP_SIZE", "a lot")
    with pytest.raises(ValueError, match="a lot"):
        ContextConfig.from_env()


def test_empty_env_variables_count_as_unset(monkeypatch):
    for name in ("IRIS_BACKEND", "IRIS_HEAP_SIZE", "IRIS_TIMEOUT", "IRIS_LOG_LEVEL", "IRIS_ON_TIMEOUT"):
        monkeypatch.setenv(name, "")
    assert ContextConfig.from_env() == ContextConfig()


@pytest.mark.parametrize(("value", "expected"),
                         [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)])
def test_debug_from_env(monkeypatch, value, expected):
    monkeypatch.setenv("IRIS_DEBUG", value)
    assert ContextConfig.from_env().debug is expected


def test_debug_argument_beats_env(monkeypatch):
    monkeypatch.setenv("IRIS_DEBUG", "1")
    assert ContextConfig.from_env(debug=False).debug is False
    monkeypatch.delenv("IRIS_DEBUG")
    assert ContextConfig.from_env(debug=True).debug is True


def test_timeout_precedence(monkeypatch):
    monkeypatch.setenv("IRIS_TIMEOUT", "12.5")
    config = ContextConfig.from_env()
    assert config.timeout == 12.5 and isinstance(config.timeout, float)
    config = ContextConfig.from_env(timeout=7)
    assert config.timeout == 7.0 and isinstance(config.timeout, float)


def test_log_level_names_and_precedence(monkeypatch):
    assert ContextConfig.from_env(log_level="debug").log_level == logging.DEBUG
    assert ContextConfig.from_env(log_level=logging.ERROR).log_level == logging.ERROR
    monkeypatch.setenv("IRIS_LOG_LEVEL", "warning")
    assert ContextConfig.from_env().log_level == logging.WARNING
    assert ContextConfig.from_env(log_level="INFO").log_level == logging.INFO


def test_bad_log_level(monkeypatch):
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        ContextConfig.from_env(log_level="loud")


def test_config_is_frozen_and_evolve_converts():
    config = ContextConfig.from_env(heap_size="4MiB")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.heap_size = 1  # type: ignore[misc]
    changed = attrs.evolve(config, heap_size="8MiB")
    assert changed.heap_size == 8 << 20
    assert config.heap_size == 4 << 20


def test_config_rejects_positional_arguments():
    with pytest.raises(TypeError):
        ContextConfig("triton")  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["abc", "0", "-1"])
def test_bad_timeout_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("IRIS_TIMEOUT", bad)
    with pytest.raises(ValueError, match="IRIS_TIMEOUT"):
        ContextConfig.from_env()


# -- on_timeout ---------------------------------------------------------------------------------


def test_on_timeout_argument():
    assert ContextConfig.from_env(on_timeout="trap").on_timeout == "trap"
    assert ContextConfig.from_env(on_timeout="raise").on_timeout == "raise"
    assert ContextConfig.from_env(on_timeout=" Trap ").on_timeout == "trap"  # as typed in a shell


def test_on_timeout_precedence(monkeypatch):
    monkeypatch.setenv("IRIS_ON_TIMEOUT", "trap")
    assert ContextConfig.from_env().on_timeout == "trap"
    assert ContextConfig.from_env(on_timeout=None).on_timeout == "trap"  # None means "not given"
    assert ContextConfig.from_env(on_timeout="raise").on_timeout == "raise"
    monkeypatch.setenv("IRIS_ON_TIMEOUT", "RAISE")
    assert ContextConfig.from_env().on_timeout == "raise"


@pytest.mark.parametrize("bad", ["abort", "0", "hang"])
def test_bad_on_timeout_argument_names_the_choices(bad):
    with pytest.raises(ValueError, match=f"on_timeout \\(IRIS_ON_TIMEOUT\\) must be one of raise, trap, got '{bad}'"):
        ContextConfig.from_env(on_timeout=bad)


def test_bad_on_timeout_from_env_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("IRIS_ON_TIMEOUT", "exit")
    with pytest.raises(ValueError, match="IRIS_ON_TIMEOUT.*raise, trap.*'exit'"):
        ContextConfig.from_env()


def test_a_misspelt_option_names_the_options():
    with pytest.raises(TypeError, match=r"unknown option 'heap_sise' \(did you mean 'heap_size'\?\); the options are "
                                        r"backend, debug, device, heap_provider, heap_size, log_level, node_size, "
                                        r"on_timeout"):
        ContextConfig.from_env(heap_sise="8MiB")
    with pytest.raises(TypeError, match=r"unknown option 'colour'; the options"):
        ContextConfig.from_env(colour="red")
    with pytest.raises(TypeError, match=r"iris.create\(\) got an unknown option 'heap_sise'"):
        iris.create(heap_sise="8MiB")  # before any process group or heap is made
