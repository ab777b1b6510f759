"""MkDocs hooks for the docs site: the CLI reference from the parser itself, a docstring check, and Griffe
extensions for the API reference: the docstrings' Sphinx roles as code, every field of a config, result or event
class as a table with its type and default, and a line for the members the source leaves without a docstring.

``docs/api/cli.md`` holds a ``<!-- cli-help -->`` marker; the build replaces it with the ``--help`` of the
command and of every subcommand, so the page cannot go stale. The build also fails (in any mode, not only
strict) when a public name of the API reference, or a public method or property of a public class, has no
docstring of its own: mkdocstrings would render it as a bare signature without a word.

Markdown tables may escape a pipe inside a code span (``str \\| None``, as the generated ``docs/config.md``
does); Python-Markdown's tables already keep a code span's pipes in their cell, and would show the backslash, so
the build drops it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import os
import re
from typing import Any

import griffe
from mkdocs.exceptions import PluginError

MARKER = "<!-- cli-help -->"

# module -> the names the API reference documents (None: the module's __all__).
PUBLIC: dict[str, list[str] | None] = {
    "elastic_runtime": None,
    "elastic_runtime.handlers": None,
    "elastic_runtime.storage": None,
    "elastic_runtime.cluster.config": ["LaunchConfig"],
    "elastic_runtime.cluster.controller": ["Controller"],
    "elastic_runtime.cluster.controller.context": ["ControllerContext"],
    "elastic_runtime.storage.gcs": ["GcsTier"],
    "elastic_runtime.cluster.worker.boundary": ["WorkerContext"],
    "elastic_runtime.testing.faults": ["FaultInjector", "FaultSchedule"],
}


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties a class defines itself (inherited ones are checked where defined)."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            members.append((name, value))
    return members


def undocumented() -> list[str]:
    """Every public name (and public member of a public class) without a docstring, as ``module.name``."""
    missing = []
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        for name in names if names is not None else module.__all__:
            obj = getattr(module, name)
            doc = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
            if not (doc or "").strip():
                missing.append(f"{module_name}.{name}")
            if isinstance(obj, type):
                missing += [
                    f"{module_name}.{name}.{member}"
                    for member, value in _own_members(obj)
                    if not (value.__doc__ or "").strip()
                ]
    return missing


def cli_help() -> str:
    """The ``--help`` of ``elastic-runtime`` and of each subcommand, as Markdown sections.

    A description that starts with its command in reST double backticks is the subcommand's summary: it goes
    above the code block as Markdown, its double backticks made code spans; the rest stays in the code block as
    ``--help`` prints it, the double backticks of the help strings dropped. Sub-subcommands get sections too.
    """
    from elastic_runtime.cli.main import build_parser

    os.environ["COLUMNS"] = "82"  # argparse wraps to the terminal: the page depends on none, and fits its column
    parser = build_parser()
    sections: list[str] = []

    def add(title: str, sub: argparse.ArgumentParser) -> None:
        prose = ""
        description = sub.description
        if description and description.lstrip().startswith("``"):
            paragraphs = [" ".join(par.split()) for par in description.strip().split("\n\n")]
            prose = "\n\n".join(_RST_CODE.sub(r"`\1`", par) for par in paragraphs)
            sub.description = None
        try:
            text = _RST_CODE.sub(r"\1", sub.format_help().rstrip())
        finally:
            sub.description = description
        sections.extend([f"## {title}", ""] + ([prose, ""] if prose else []) + ["```", text, "```", ""])
        for action in sub._subparsers._group_actions if sub._subparsers else []:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    add(f"{title} {name}", child)

    add("elastic-runtime", parser)
    return "\n".join(sections)


_RST_CODE = re.compile(r"``([^`]+)``")
# A code span inside a Markdown table row, where ``\|`` needs no escape.
_TABLE_CODE = re.compile(r"`[^`\n]*`")


def unescape_table_code(markdown: str) -> str:
    """``| `str \\| None` |`` -> ``| `str | None` |``: in a table row, a code span's pipes need no backslash."""
    lines = markdown.split("\n")
    fence = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.lstrip().startswith("|") and "\\|" in line:
            lines[i] = _TABLE_CODE.sub(lambda m: m.group(0).replace("\\|", "|"), line)
    return "\n".join(lines)


def on_pre_build(config: Any) -> None:
    missing = undocumented()
    if missing:
        raise PluginError("public names without a docstring: " + ", ".join(missing))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_help())
    return unescape_table_code(markdown)


# Material breaks a code span anywhere (``word-break: break-word``): in a table's narrow first column a field
# name broke mid-word. There (the name a row is about) a code span breaks only after an underscore, which
# ``on_page_content`` marks; the other columns still break long code, so that the table fits its page.
_TABLE_CSS = "<style>.md-typeset table td:first-child code { word-break: normal; overflow-wrap: normal; }</style>"
_FIRST_CELL_CODE = re.compile(r"(<tr>\s*<td>\s*<code>)([^<]+)(</code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _FIRST_CELL_CODE.sub(lambda m: m.group(1) + m.group(2).replace("_", "_<wbr>") + m.group(3), html)


def on_post_page(output: str, page: Any, config: Any) -> str:
    return output.replace("</head>", _TABLE_CSS + "</head>", 1)


class SphinxRoles(griffe.Extension):
    """Griffe extension: the docstrings' Sphinx roles (``:class:`Event```, ``:meth:`~Runtime.run```) as code.

    The source's docstrings are read in editors and by ``help()`` too, where the roles are the convention;
    on the site they would show as raw text. ``~`` (show only the last name) is honoured.
    """

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_as_code, obj.docstring.value)


ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


# --- every field of a config, a result or an event, as a table ---------------------------------------------------

# The modules whose msgspec Structs and dataclasses get a field table: (type, default, meaning) of every field.
FIELD_MODULES = (
    "elastic_runtime.core.config",
    "elastic_runtime.core.executor",
    "elastic_runtime.core.events",
    "elastic_runtime.cluster.config",
)
# The range types of runtime/core/config.py as the base type they constrain (their range is in the table).
RANGE_TYPES = {"Positive": "int", "NonNegative": "int", "Seconds": "float", "SecondsOrZero": "float", "Port": "int"}
# The fields every event has (``Event``'s), described here since ``Event``'s docstring says them in one line.
EVENT_BASE = {
    "wall_time": "when it happened, seconds since the epoch",
    "mono_time": "when it happened, on the monotonic clock of the process that made it",
    "step": "the step it is about, where known",
    "source": "who said so: a component, ``worker-N``, the controller",
}
_SECTIONS = {"attributes", "args", "arguments", "params", "parameters", "raises", "returns", "yields", "examples",
             "example", "note", "notes", "warning", "warnings", "see also"}  # fmt: skip
_ENTRY = re.compile(r"^ {4}(\w+(?:, \w+)*): ?(.*)$")


class FieldTables(griffe.Extension):
    """Griffe extension: the docstring of a config, result or event class gets one ``Attributes`` table of every
    field, its type (a range type as its base type), its meaning and its default (and range), in the docstring's
    own groups. ``RuntimeConfig``'s docstring groups its fields under headings of its own (``Checkpointing
    (...):``), which Google style reads as prose; an entry may name several fields (``a, b: ...``); events say
    their fields in prose: each field gets the clause of the docstring that names it. The source's docstring is
    untouched: only the site's rendering changes.
    """

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.module.path not in FIELD_MODULES or cls.docstring is None:
            return
        try:
            runtime_cls = getattr(importlib.import_module(cls.module.path), cls.name)
        except (ImportError, AttributeError):
            return
        fields = _fields(runtime_cls)
        parent = runtime_cls.__mro__[1]
        inherited = {name for name, _ in _fields(parent)} if parent is not object else set()
        own = [(name, default) for name, default in fields if name not in inherited]
        if own:
            base = parent.__name__ if inherited else None
            cls.docstring.value = field_docstring(cls, runtime_cls, own, inherited_from=base)


def _fields(runtime_cls: Any) -> list[tuple[str, str]]:
    """(name, its default as Markdown) of each field of a msgspec Struct or a dataclass, in order."""
    import msgspec

    if isinstance(runtime_cls, type) and issubclass(runtime_cls, msgspec.Struct) and runtime_cls is not msgspec.Struct:
        return [
            (f.name, _default(f.default, f.default_factory, msgspec.NODEFAULT))
            for f in msgspec.structs.fields(runtime_cls)
        ]
    if dataclasses.is_dataclass(runtime_cls):
        return [
            (f.name, _default(f.default, f.default_factory, dataclasses.MISSING))
            for f in dataclasses.fields(runtime_cls)
        ]
    return []


def _default(default: Any, factory: Any, missing: Any) -> str:
    if default is not missing:
        value = default
    elif factory is not missing:
        if inspect.isfunction(factory):  # e.g. the event's clock: a value made with the object
            return "when made"
        value = factory()
    else:
        return "required"
    if isinstance(value, enum.Enum):
        return f"`{type(value).__name__}.{value.name}`"
    return f"`{value!r}`"


def _ranges(runtime_cls: Any) -> dict[str, str]:
    """Field -> its ``msgspec.Meta`` range (``>= 1``), for a msgspec Struct."""
    import msgspec

    if not (isinstance(runtime_cls, type) and issubclass(runtime_cls, msgspec.Struct)):
        return {}
    found: dict[str, str] = {}
    info = msgspec.inspect.type_info(runtime_cls)
    for field in getattr(info, "fields", ()):
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for kind in kinds:
            for bound, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if getattr(kind, bound, None) is not None:
                    found[field.name] = f"{found[field.name]}, " if field.name in found else ""
                    found[field.name] += f"{symbol} {getattr(kind, bound)}"
    return found


def _annotation(cls: griffe.Class, name: str) -> str:
    member = cls.all_members.get(name) if hasattr(cls, "all_members") else None
    annotation = str(getattr(member, "annotation", "") or "")
    return re.sub(r"\b(" + "|".join(RANGE_TYPES) + r")\b", lambda m: RANGE_TYPES[m.group(1)], annotation)


def field_docstring(
    cls: griffe.Class, runtime_cls: Any, fields: list[tuple[str, str]], *, inherited_from: str | None = None
) -> str:
    """``cls``'s docstring with its fields as ``Attributes`` sections: the docstring's text, then one section per
    group of entries (the ``Attributes:`` section, and each heading of its own followed by entries), every field
    in one of them (those no entry names in the first, or in a ``Fields`` section of their own, which names the
    class whose fields it has too), then whatever other sections the docstring had."""
    names = [name for name, _ in fields]
    defaults = dict(fields)
    ranges = _ranges(runtime_cls)
    lines = inspect.cleandoc(cls.docstring.value if cls.docstring else "").split("\n")
    intro: list[str] = []
    groups: list[tuple[str, list[tuple[list[str], str]]]] = []  # (title, [(names, description)])
    rest: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        header = re.match(r"^(\S.*):\s*$", line)
        nxt = _ENTRY.match(lines[i + 1]) if i + 1 < len(lines) else None
        if header and nxt and set(nxt.group(1).split(", ")) <= set(names):
            title = header.group(1).strip()
            title = "" if title.lower() == "attributes" else _RST_CODE.sub(r"\1", title) + ":"
            entries: list[tuple[list[str], str]] = []
            i += 1
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                entry = _ENTRY.match(lines[i])
                if entry:
                    entries.append((entry.group(1).split(", "), entry.group(2).strip()))
                elif lines[i].strip() and entries:
                    entries[-1] = (entries[-1][0], entries[-1][1] + " " + lines[i].strip())
                elif not lines[i].strip() and i + 1 < len(lines) and not lines[i + 1].startswith("    "):
                    break
                i += 1
            groups.append((title, entries))
            continue
        if (header and header.group(1).strip().lower() in _SECTIONS) or rest:
            rest.append(line)
        elif not groups:
            intro.append(line)
        else:
            rest.append(line)
        i += 1

    described = {name for _, entries in groups for entry_names, _ in entries for name in entry_names}
    missing = [name for name in names if name not in described]
    prose = " ".join(" ".join(intro).split())
    if missing:
        extra = [([name], EVENT_BASE.get(name, "") or _clause(name, prose)) for name in missing]
        if groups:
            groups[0] = (groups[0][0], groups[0][1] + extra)
        else:
            groups.append((f"Fields (and those of {inherited_from}):" if inherited_from else "Fields:", extra))

    out = [*intro]
    for title, entries in groups:
        rows = []
        for entry_names, description in entries:  # ``a, b: text``: the text once, the others pointing to it
            for k, name in enumerate(n for n in entry_names if n in defaults):
                rows.append(
                    _entry(cls, name, description if k == 0 else f"as ``{entry_names[0]}`` says", defaults, ranges)
                )
        out += ["", f"Attributes: {title}".rstrip(), *rows]
    if rest:
        out += ["", *rest]
    return "\n".join(out).strip("\n")


def _entry(cls: griffe.Class, name: str, description: str, defaults: dict[str, str], ranges: dict[str, str]) -> str:
    kind = _annotation(cls, name)
    fact = f"Default: {defaults[name]}" if defaults[name] != "required" else "Required"
    if name in ranges:
        fact += f" (range `{ranges[name]}`)"
    text = (description.rstrip() + "<br>" if description else "") + fact + "."
    return f"    {name} ({kind}): {text}" if kind else f"    {name}: {text}"


def _clause(name: str, prose: str) -> str:
    """The clause of ``prose`` that names ``name`` as code (in backticks), or ""."""
    clauses, depth, start = [], 0, 0
    for i, char in enumerate(prose):
        depth += char == "("
        depth -= char == ")"
        end_of_sentence = char == "." and prose[i + 1 : i + 2] in (" ", "")
        if depth == 0 and (char == ";" or end_of_sentence):
            clauses.append(prose[start:i])
            start = i + 1
    clauses.append(prose[start:])
    for clause in clauses:
        if re.search(r"``?" + re.escape(name) + r"``?", clause):
            clause = clause.strip()
            return clause[:1].upper() + clause[1:]
    return ""
