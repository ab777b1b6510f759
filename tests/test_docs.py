"""The docs say what the code has: docs/events.md is exactly the catalogue generated from the event classes,
every module path that docs/architecture.md and the README's layout name exists, and the docs site builds
in strict mode (a broken link, a page missing from the nav, a public name without a docstring fail it).

Regenerate the catalogue after changing an event: ``.venv/bin/python tests/test_docs.py > docs/events.md``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

import elastic_runtime
import elastic_runtime.core.events as ev

ROOT = Path(__file__).resolve().parent.parent

GROUPS: list[tuple[str, ModuleType, list[str]]] = [
    ("Run progress", ev, ["RunStarted", "RunFinished", "StepCompleted"]),
    ("Failures (all derive from `Failure`)", ev, [
        "Failure", "StepFailed", "DeviceLost", "SliceLost", "ProcessLost", "WorkerLost", "WorkerHung",
        "MalformedHeartbeat", "ConnectionRefused", "HandlerFailed", "CheckpointFailed", "CheckpointCorrupt",
        "MalformedNotice", "NoticeIgnored", "NoticeSourceFailed", "RecoveryFailed", "DataMismatch",
        "SilentCorruption",
    ]),
    ("Conditions", ev, ["Straggler", "MeshReduced", "ConfigOverridden", "NoticeSourceReady"]),
    ("Maintenance notices (all derive from `Notice`)", ev, [
        "Notice", "MaintenanceScheduled", "MaintenanceStarted", "MaintenanceCompleted", "Preempted", "HostError",
    ]),
    ("Checkpoints", ev, [
        "CheckpointStarted", "CheckpointCommitted", "CheckpointSkipped", "CheckpointBehind", "ReplicaSkipped",
    ]),
    ("Recovery", ev, [
        "RecoveryStarted", "MeshChanged", "StateRestored", "RecoveryCompleted", "ScaleUpAvailable", "StateTransformed",
        "MeshReady", "LikelyMeshesReady", "CorruptionHealed",
    ]),
    ("Requests", ev, ["SaveCheckpoint", "Drain"]),
    ("Multi-process groups (logged by the controller)", ev, [
        "WorkerStarted", "WorkerExited", "WorkerKilled", "WorkerSignalled", "GroupForming", "GroupFormed",
    ]),
]  # fmt: skip

INTRO = """# Event catalogue

Every event is a frozen, keyword-only `msgspec.Struct` deriving from `Event`, all defined in
`runtime/core/events.py`. Each carries `wall_time`
(epoch s), `mono_time` (monotonic s), `step` (where known) and `source`; the JSON tag `type` is the class
name. Facts are in the past tense, requests in the imperative. Subscribing to a base class (`Failure`,
`DeviceLost`, `Notice`, `Event`) delivers its subclasses too. Your own subclasses of `Event` are logged and
read back like these once their module is imported.

This page is generated from the classes' docstrings and fields by `tests/test_docs.py`, which also checks
that it is up to date.
"""


def render_catalogue() -> str:
    base = {f.name for f in msgspec.structs.fields(ev.Event)}
    lines = [INTRO]
    for title, module, names in GROUPS:
        lines += [f"## {title}", "", "| event | fields | meaning |", "| --- | --- | --- |"]
        for name in names:
            cls = getattr(module, name)
            parent = cls.__mro__[1]
            inherited = set() if parent is ev.Event else {f.name for f in msgspec.structs.fields(parent)}
            own = [f"`{f.name}`" for f in msgspec.structs.fields(cls) if f.name not in base | inherited]
            origin = "" if parent is ev.Event else f"({parent.__name__}) "
            doc = " ".join((cls.__doc__ or "").split()).replace("|", "\\|")
            lines.append(f"| `{name}` | {origin}{', '.join(own) or '-'} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def test_every_public_event_is_in_a_group() -> None:
    grouped = {name for _, _, names in GROUPS for name in names}
    public = {
        name
        for name in elastic_runtime.__all__
        if isinstance(getattr(elastic_runtime, name), type) and issubclass(getattr(elastic_runtime, name), ev.Event)
    }
    assert public - grouped == {"Event"}


def test_the_catalogue_is_up_to_date() -> None:
    assert (ROOT / "docs" / "events.md").read_text() == render_catalogue(), (
        "docs/events.md is stale: .venv/bin/python tests/test_docs.py > docs/events.md"
    )


# A path in the docs: under one of the top-level folders, e.g. `runtime/core/events.py` or `storage/`.
PATH = re.compile(r"(?<![\w./-])((?:runtime|handlers|storage|tests|examples|docs)/(?:[\w./-]*\w/?)?)")


def named_paths(text: str) -> set[str]:
    """Every path the text names, with the bare file names of a ``| `folder/` | `a.py`, ... |`` table row
    joined to their folder (the way docs/architecture.md's "Where things live" lists them)."""
    found = set(PATH.findall(text))
    for row in re.finditer(r"^\| `([\w/]+/)` \|(.*)\|$", text, flags=re.M):
        found |= {row.group(1) + name for name in re.findall(r"`(\w+\.py)`", row.group(2))}
    return found


def test_architecture_names_only_modules_that_exist() -> None:
    paths = named_paths((ROOT / "docs" / "architecture.md").read_text())
    assert len(paths) > 40  # the table was read: not an empty check
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_architecture_names_every_module() -> None:
    """The "Where things live" table lists every module of each folder it has a row for: a module added without a
    word there fails here (the check above only catches names that went away)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `([\w/]+/)` \|(.*)\|$", text, flags=re.M))
    assert len(rows) > 10
    missing = [
        folder + path.name
        for folder, row in rows.items()
        for path in sorted((ROOT / folder).glob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in row
    ]
    assert missing == []


@pytest.mark.parametrize(
    "page",
    sorted(
        str(p.relative_to(ROOT / "docs"))
        for p in [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("internals/*.md")]
        if p.name != "benchmarks-history.md"
    ),
)
def test_every_page_names_only_paths_that_exist(page: str) -> None:
    """The history page names modules as they were on the day of each run; every other page (the internals of
    docs/internals/ too), as they are."""
    paths = named_paths((ROOT / "docs" / page).read_text())
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_the_readme_layout_names_only_paths_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :].split("\n## ")[0]
    paths = named_paths(layout)
    assert {"runtime/core/", "runtime/defaults/", "handlers/", "storage/"} <= paths
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_named_paths_finds_a_module_that_does_not_exist() -> None:
    text = "| `storage/` | `tier.py`, `peer.py` (replicas) |\nsee `runtime/cluster/events.py`."
    missing = {p for p in named_paths(text) if not (ROOT / p).exists()}
    assert missing == {"storage/peer.py", "runtime/cluster/events.py"}


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_every_public_name_of_the_api_reference_has_a_docstring() -> None:
    assert load_hooks().undocumented() == []


def test_the_docstring_check_finds_a_name_without_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "undocumented_mod.py").write_text(
        '__all__ = ["Documented", "bare"]\n\n\nclass Documented:\n    """Has one."""\n\n'
        "    def method(self) -> None:\n        pass\n\n\ndef bare() -> None:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = load_hooks()
    monkeypatch.setattr(hooks, "PUBLIC", {"undocumented_mod": None})
    assert hooks.undocumented() == ["undocumented_mod.Documented.method", "undocumented_mod.bare"]


@pytest.mark.timeout(600)
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=570,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "site" / "api" / "runtime" / "index.html").read_text()
    assert "elastic_runtime.TrainJob" in page or 'id="elastic_runtime.TrainJob"' in page
    cli = (tmp_path / "site" / "api" / "cli" / "index.html").read_text()
    assert "elastic-runtime launch" in cli and "--nprocs" in cli


if __name__ == "__main__":
    print(render_catalogue(), end="")


SHOWN = re.compile(r"(?:^|\s|/)elastic-runtime ((?:demo|launch|controller|listen|report|checkpoints)(?:\s.*)?)$")


def shown_commands(text: str) -> list[str]:
    """Every ``elastic-runtime`` command in a page's code blocks (continuation lines joined)."""
    commands: list[str] = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            found = re.search(
                r"(?:^|\s|/)elastic-runtime ((?:demo|launch|controller|listen|report|checkpoints)(?:\s.*)?)$", line
            )
            if found and not line.startswith("#"):
                commands.append(found.group(1).split(" #")[0].split(" | ")[0].strip())
    return commands


PAGES = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", [*PAGES, "README.md"])
def test_every_command_the_docs_show_parses(page: str) -> None:
    """A command a reader copies runs: each one shown parses with the real command line's parser."""
    from elastic_runtime.cli.main import build_parser

    path = ROOT / page
    parser = build_parser()
    for command in shown_commands(path.read_text()):
        try:
            parser.parse_args(shlex.split(command))
        except SystemExit:
            pytest.fail(f"{page}: `elastic-runtime {command}` does not parse")


def test_the_command_check_finds_one_that_does_not_parse() -> None:
    from elastic_runtime.cli.main import build_parser

    [command] = shown_commands("```\nelastic-runtime launch --nprocs three -- python t.py\n```\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split(command))
