"""`to_toml`: render a mapping as a TOML document.

Every Metronome binary reads TOML; the roles build each config as a mapping (role
defaults combined with inventory overrides) and render it with this filter, so quoting
and escaping are right by construction. Keys whose value is None are left out, which
lets an inventory unset an optional setting. A list of mappings becomes an array of tables (`[[gpu]]`). Key order is kept, so a rendered file only
changes when a setting does (the idempotence the playbooks depend on).
"""

import json
import math
import re

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key):
    key = str(key)
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _value(value):
    # bool before int: in Python a bool is an int.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value))
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes.
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, dict):
        inner = ", ".join(
            f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None
        )
        return "{ " + inner + " }" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    raise TypeError(f"to_toml: cannot render a {type(value).__name__} ({value!r})")


def _is_table_array(value):
    return isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value)


def _table(lines, path, table, header="[{}]"):
    scalars = [
        (k, v)
        for k, v in table.items()
        if v is not None and not isinstance(v, dict) and not _is_table_array(v)
    ]
    tables = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    arrays = [(k, v) for k, v in table.items() if _is_table_array(v)]
    if path and (scalars or header != "[{}]" or not (tables or arrays)):
        if lines:
            lines.append("")
        lines.append(header.format(".".join(_key(p) for p in path)))
    for key, value in scalars:
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in tables:
        _table(lines, path + [key], value)
    for key, values in arrays:
        for value in values:
            _table(lines, path + [key], value, header="[[{}]]")


def to_toml(data):
    """Render `data` (a mapping) as a TOML document ending in a newline."""
    if not isinstance(data, dict):
        raise TypeError("to_toml: the top level must be a mapping")
    lines = []
    _table(lines, [], data)
    return "\n".join(lines) + "\n"


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self):
        return {"to_toml": to_toml}
