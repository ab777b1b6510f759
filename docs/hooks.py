"""MkDocs hooks for the docs site: the CLI reference from the parser itself, a docstring check, and a Griffe
extension that shows the docstrings' Sphinx roles as code.

``docs/api/cli.md`` holds a ``<!-- cli-help -->`` marker; the build replaces it with the ``--help`` of the
command and of every subcommand, so the page cannot go stale. The build also fails (in any mode, not only
strict) when a public name of the API reference, or a public method or property of a public class, has no
docstring of its own: mkdocstrings would render it as a bare signature without a word.
"""

from __future__ import annotations

import argparse
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
    """The ``--help`` of ``elastic-runtime`` and of each subcommand, as Markdown sections."""
    from elastic_runtime.cli.main import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page should not depend on one
    parser = build_parser()
    sections = ["## elastic-runtime", "", "```", parser.format_help().rstrip(), "```", ""]
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sections += [f"## elastic-runtime {name}", "", "```", sub.format_help().rstrip(), "```", ""]
    return "\n".join(sections)


def on_pre_build(config: Any) -> None:
    missing = undocumented()
    if missing:
        raise PluginError("public names without a docstring: " + ", ".join(missing))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_help())
    return markdown


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
