"""Reading job files: YAML that refuses repeated keys, and `a.b=value` overrides with YAML-typed values."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from visionrl.errors import InputError


class ConfigError(InputError):
    """A job file is malformed; the message says which key, what is wrong and what to do."""


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML would silently keep the last one,
    dropping e.g. a whole first `train:` section), and reads booleans as YAML 1.2 does: only true and false.
    PyYAML's YAML 1.1 also turns yes, no, on and off into booleans, so a judge's `yes: yes` became {True: True}
    and the word was lost."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _construct_unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` merges; a key written next to it overrides the merged one (YAML rule)
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str | int | float | bool):
            continue  # unhashable keys: construct_mapping reports them
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping; keep only one", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.path=value (e.g. train.steps=10)")
    key, _, raw = item.partition("=")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key part; write it as section.key=value")
    # YAML parsing gives numbers, booleans, null and lists their natural types ("[a, b]", "1e-3", "true").
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{item}': value is not valid YAML ({err.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` items into a nested dict (a new dict; the input is not modified)."""
    out = _deep_copy(data)
    for item in overrides:
        path, value = _parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{item}': '{part}' is a value, not a section, so it has no key '{path[-1]}'"
                )
            node = child
        node[path[-1]] = value
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


class Section(BaseModel):
    """The base of every job-file section: unknown keys are errors, values are validated on assignment."""

    # allow_inf_nan=False: `.inf` and `.nan` are valid YAML floats, and `train.lr: .inf` would only show up as a
    # non-finite loss after the run started; every float field refuses them at validation.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
