"""Settings models: strict, frozen, unknown keys rejected, and one message per ValidationError
that names each key by its full path, what it allows and the bad value (never a secret)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import ConfigDict, Field, PositiveInt, SecretStr, ValidationError

from hicache.tiers.settings import Settings, explain


class Inner(Settings):
    model_config = ConfigDict(extra="allow")

    limit: float = Field(1.0, ge=0, description="how far")


class Outer(Settings):
    count: PositiveInt = Field(1, description="how many")
    mode: Literal["fast", "safe"] | None = Field(None, description="how")
    port: int = Field(0, ge=0, le=9, description="where")
    name: str = Field("x", min_length=1)
    address: str = Field("a:1", pattern=r"^\w+:\d+$")
    password: SecretStr | None = None
    flag: bool = False
    inner: Inner = Field(default_factory=Inner)
    required: str = "set"


def message(data: dict, **kw: str) -> str:
    with pytest.raises(ValidationError) as err:
        Outer.model_validate(data)
    return explain(err.value, Outer, **kw)


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        ({"count": 0}, "count must be a positive integer (got 0) (how many)"),
        ({"count": "3"}, "count must be a positive integer (got '3') (how many)"),
        ({"count": True}, "count must be a positive integer (got True) (how many)"),
        ({"mode": "slow"}, "mode='slow' is not supported; allowed values: ['fast', 'safe'] (how)"),
        ({"port": 10}, "port must be an integer in [0, 9] (got 10) (where)"),
        ({"name": ""}, "name must be a non-empty string (got '')"),
        ({"address": "nope"}, r"address must be a string matching ^\w+:\d+$ (got 'nope')"),
        ({"flag": 1}, "flag must be true or false (got 1)"),
        ({"inner": {"limit": -1}}, "inner.limit must be a number >= 0 (got -1) (how far)"),
        ({"inner": 3}, "inner must be a JSON object (got 3)"),
    ],
)
def test_each_error_names_key_rule_and_value(data, expect):
    assert message(data) == expect


def test_prefix_unknown_keys_and_several_errors():
    msg = message({"zz": 1, "count": 0, "aa": 2, "inner": {"free": "kept"}},
                  unknown="settings key(s) here:")
    assert msg.startswith("unknown settings key(s) here: ['aa', 'zz']; allowed keys: "
                          "['address', 'count', 'flag', 'inner', ")
    assert msg.endswith("; count must be a positive integer (got 0) (how many)")
    assert message({"count": 0}, prefix="cfg.").startswith("cfg.count must be")


def test_secret_values_never_show():
    msg = message({"password": 123456789})
    assert "123456789" not in msg and "password must be a string or null" in msg
    assert "a secret int" in msg


def test_missing_required_key():
    class Needs(Settings):
        where: str = Field(description="host:port")

    with pytest.raises(ValidationError) as err:
        Needs.model_validate({})
    assert explain(err.value, Needs, prefix="x.") == "x.where is required (host:port)"


def test_settings_are_frozen_and_strict():
    outer = Outer.model_validate({"inner": {"limit": 2, "free": 1}})
    assert outer.inner.limit == 2.0 and outer.inner.model_extra == {"free": 1}
    with pytest.raises(ValidationError, match="frozen"):
        outer.count = 2  # type: ignore[misc]
