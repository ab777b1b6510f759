"""docs/config.md is exactly the field list generated from RuntimeConfig: its types, defaults and docstring.

Regenerate it after changing a field: ``.venv/bin/python tests/test_config_docs.py > docs/config.md``.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from elastic_runtime.core.config import ENV_PREFIX, RuntimeConfig

ROOT = Path(__file__).resolve().parent.parent

INTRO = f"""# Configuration reference

Every field of `RuntimeConfig` (`runtime/core/config.py`), with its type, default and meaning. Build one in
code (`RuntimeConfig(run_dir="runs/a", keep=5)`), or load it with `elastic_runtime.load_config(path)`: defaults, then
the `[runtime]` table of a TOML file, then `{ENV_PREFIX}<FIELD>` environment variables (upper case), which win.
The variables apply only through `load_config`; a `RuntimeConfig` built in code reads no environment. A bad
value raises `ConfigError` naming the field, whichever way the config was made.

This page is generated from the class by `tests/test_config_docs.py`, which also checks that it is up to
date and that every field has a description.
"""


def descriptions() -> dict[str, str]:
    """Field name -> its description, from the docstring's ``name: text`` entries (continuations joined)."""
    found: dict[str, str] = {}
    current = ""
    # cleandoc: Python 3.13 strips a docstring's indentation when it compiles it, 3.11 keeps it.
    for line in inspect.cleandoc(RuntimeConfig.__doc__ or "").splitlines():
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry and entry.group(1) in RuntimeConfig.__struct_fields__:
            current = entry.group(1)
            found[current] = entry.group(2).strip()
        elif current and re.match(r"^ {8}\S", line):
            found[current] += " " + line.strip()
        else:
            current = ""
    return found


def type_name(kind: Any) -> str:
    """``int``, ``str | None``, ``tuple[str, ...]``, ``dict[str, tuple[int, ...]]``: as the code spells it."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is None:
        return "None" if kind is type(None) else "..." if kind is Ellipsis else getattr(kind, "__name__", str(kind))
    return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"


def bounds() -> dict[str, str]:
    """Field name -> its ``msgspec.Meta`` range, as the config checks it (``>= 1``, ``> 0``)."""
    info = msgspec.inspect.type_info(RuntimeConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    found = {}
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for kind in kinds:
            for bound, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                limit = getattr(kind, bound, None)
                if limit is not None:
                    found[field.name] = f"{symbol} {limit}"
    return found


def render_config() -> str:
    described, ranges = descriptions(), bounds()
    hints = typing.get_type_hints(RuntimeConfig)  # without the msgspec.Meta bounds: they have their column
    lines = [INTRO, "| field | type | range | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for field in msgspec.structs.fields(RuntimeConfig):
        kind = type_name(hints[field.name]).replace("|", "\\|")
        limit = f"`{ranges[field.name]}`" if field.name in ranges else ""
        default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
        meaning = described.get(field.name, "").replace("|", "\\|")
        lines.append(f"| `{field.name}` | `{kind}` | {limit} | `{default!r}` | {meaning} |")
    return "\n".join(lines) + "\n"


def test_every_field_is_described() -> None:
    missing = set(RuntimeConfig.__struct_fields__) - set(descriptions())
    assert not missing, f"RuntimeConfig fields without a description in its docstring: {sorted(missing)}"


def test_the_reference_is_up_to_date() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == render_config(), (
        "docs/config.md is stale: .venv/bin/python tests/test_config_docs.py > docs/config.md"
    )


if __name__ == "__main__":
    print(render_config(), end="")
