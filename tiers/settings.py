"""Settings models: the pydantic base of every HiCache config model, and one clear
message from a ``ValidationError``.

Contract:
- ``Settings`` is frozen, strict (no ``"64"`` for an int, no ``True`` for a
  number) and forbids unknown keys. Each field's ``description`` says what it
  means; its type and constraints (``Literal``, ``gt``/``ge``/``le``,
  ``min_length``, ``pattern``) are the only statement of what is allowed.
- ``explain(exc, model, ...)`` turns a ``ValidationError`` of ``model`` into
  one message that names every bad key by its full path (``prefix`` + the
  key path), what it allows (the values of a ``Literal``, the constraint
  read from the model's JSON schema) and the bad value. Values of secret
  fields (``SecretStr``) never appear in it: only their type does. Unknown
  keys are reported together, with the allowed keys.
- Engine-free: pydantic only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails


class Settings(BaseModel):
    """Base of a config model: frozen, strict, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


def explain(exc: ValidationError, model: type[BaseModel], *, prefix: str = "",
            unknown: str = "key(s)") -> str:
    """One message for every error of ``exc`` (raised validating ``model``).

    ``prefix`` is prepended to each key path (``"hicache_storage_backend_extra_config."``);
    ``unknown`` names where unknown keys were found
    (``"kv_connector_extra_config key(s) for HiCacheConnector:"``).
    """
    schema = model.model_json_schema()
    unknown_keys: list[str] = []
    parts: list[str] = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        if error["type"] == "extra_forbidden":
            unknown_keys.append(".".join(loc))
            continue
        parts.append(_explain_one(error, prefix + ".".join(loc), _field_schema(schema, loc)))
    if unknown_keys:
        allowed = sorted(schema.get("properties", {}))
        parts.insert(0, f"unknown {unknown} {sorted(unknown_keys)}; allowed keys: {allowed}")
    return "; ".join(parts)


def _explain_one(error: ErrorDetails, path: str, field: Mapping[str, Any]) -> str:
    note = f" ({field['description']})" if field.get("description") else ""
    if error["type"] == "missing":
        return f"{path} is required{note}"
    shown = _shown(error["input"], field)
    if error["type"] == "literal_error":
        return f"{path}={shown} is not supported; allowed values: {_choices(field)}{note}"
    if error["type"] in ("value_error", "assertion_error"):
        return f"{path}={shown}: {error.get('ctx', {}).get('error', error['msg'])}{note}"
    return f"{path} must be {_rule(field)} (got {shown}){note}"


def _shown(value: Any, field: Mapping[str, Any]) -> str:
    """The bad value as the message shows it; a secret only by its type."""
    if any(option.get("format") == "password" for option in _options(field)):
        return f"a secret {type(value).__name__}"
    return repr(value)


def _field_schema(schema: Mapping[str, Any], loc: Sequence[str]) -> Mapping[str, Any]:
    """The JSON schema of the field at ``loc`` (through nested models), or {}."""
    defs = schema.get("$defs", {})
    node: Mapping[str, Any] = schema
    for part in loc:
        node = _resolve(node, defs)
        properties = node.get("properties", {})
        if part not in properties:
            return {}
        node = properties[part]
    return node


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    for option in _options(node):
        if "$ref" in option:
            return defs.get(option["$ref"].rsplit("/", 1)[-1], {})
        if "properties" in option:
            return option
    return node


def _options(field: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The non-null alternatives of a field (``X | None`` is ``anyOf``)."""
    options = field.get("anyOf", [field])
    return [option for option in options if option.get("type") != "null"]


def _choices(field: Mapping[str, Any]) -> list[Any]:
    choices: list[Any] = []
    for option in _options(field):
        choices += option.get("enum", [option["const"]] if "const" in option else [])
    return choices


def _rule(field: Mapping[str, Any]) -> str:
    """What a field allows, in words: 'a positive integer', 'a number >= 0', ..."""
    rules = [_rule_of(option) for option in _options(field)] or ["a valid value"]
    if "null" in [option.get("type") for option in field.get("anyOf", [])]:
        rules.append("null")
    return " or ".join(rules)


_NOUNS = {"integer": "an integer", "number": "a number", "string": "a string",
          "boolean": "true or false", "object": "a JSON object", "array": "a list"}


def _rule_of(option: Mapping[str, Any]) -> str:
    if "enum" in option or "const" in option:
        return f"one of {_choices(option)}"
    if "$ref" in option or "properties" in option:
        return "a JSON object"
    kind = option.get("type", "")
    low, high = option.get("minimum"), option.get("maximum")
    if kind == "integer" and option.get("exclusiveMinimum") == 0 and high is None:
        return "a positive integer"
    noun = _NOUNS.get(kind, f"a {kind or 'value'}")
    if option.get("minLength") == 1:
        noun = noun.replace("a ", "a non-empty ", 1)
    if low is not None and high is not None:
        return f"{noun} in [{low}, {high}]"
    bounds = [noun]
    if "exclusiveMinimum" in option:
        bounds.append(f"> {option['exclusiveMinimum']}")
    if low is not None:
        bounds.append(f">= {low}")
    if high is not None:
        bounds.append(f"<= {high}")
    if "pattern" in option:
        bounds.append(f"matching {option['pattern']}")
    return " ".join(bounds)
