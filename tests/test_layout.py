"""The package layout: one import name of the library's own, every package works as a program's first import,
the core stands alone, and a user's own ``handlers.py``, ``storage/`` or ``runtime.py`` shadows nothing."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_runtime import GroupFormed, read_events

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(
    "first",
    ["elastic_runtime.storage", "elastic_runtime.storage.disk", "elastic_runtime.handlers",
     "elastic_runtime.handlers.regroup", "elastic_runtime", "elastic_runtime.cli"],
)  # fmt: skip
def test_each_package_works_as_the_first_import(first: str) -> None:
    done = run_python(f"import {first}\nimport elastic_runtime\nprint(elastic_runtime.ElasticRuntime.__module__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "elastic_runtime.defaults.elastic"


def test_the_core_loads_no_handler_storage_or_other_runtime_layer() -> None:
    done = run_python(
        "import sys, elastic_runtime, elastic_runtime.core.runtime, elastic_runtime.core.executor\n"
        "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules if m.startswith('elastic_runtime.')}))"
    )
    assert done.returncode == 0, done.stderr
    # elastic_runtime.compat is the layer below the core: `import elastic_runtime` loads its xla module first, to
    # raise XLA's CPU collective timeout before any backend starts (runtime/compat/xla.py).
    assert done.stdout.strip() == "['elastic_runtime.compat', 'elastic_runtime.core']"


@pytest.mark.parametrize(("old", "new"), [("runtime", "elastic_runtime"), ("handlers", "elastic_runtime.handlers"),
                                          ("storage", "elastic_runtime.storage")])  # fmt: skip
def test_an_old_import_name_still_works_for_one_release_and_warns(tmp_path: Path, old: str, new: str) -> None:
    """Outside the repository (only the installed package), the old name is the new module itself, submodules too."""
    done = run_python(
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        f"import {old}, {new}\n"
        "import elastic_runtime.core.events as new_events\n"
        "import runtime.core.events as old_events\n"
        f"print({old} is {new}, old_events is new_events, old_events.__spec__.name)",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "elastic_runtime.core.events"]
    assert f"DeprecationWarning: the import name {old!r} is deprecated" in done.stderr
    assert f"import {new!r} instead" in done.stderr


USER_SCRIPT = """
    import json, sys

    import handlers, runtime, storage  # the user's own modules, beside this script

    from elastic_runtime import ElasticRuntime, MeshPolicy, RunFinished
    from elastic_runtime.testing.demo_model import demo_job

    print(json.dumps({"mine": [handlers.WHO, runtime.WHO, storage.WHO]}), flush=True)
    job = demo_job(global_batch=8, features=8, hidden=16)
    elastic = ElasticRuntime(job, mesh_policy=MeshPolicy({"data": 1, "model": 1}))
    finished = []

    @elastic.on(RunFinished)
    async def note(event, ctx):
        finished.append(event.ok)

    result = elastic.run(3)
    print(json.dumps({"step": result.step, "finished": finished}))
"""


def write_user_folder(folder: Path) -> Path:
    """A training script beside a ``handlers.py``, a ``runtime.py`` and a ``storage/`` of the user's own."""
    folder.mkdir(exist_ok=True)
    (folder / "handlers.py").write_text("WHO = 'user handlers'\n")
    (folder / "runtime.py").write_text("WHO = 'user runtime'\n")
    (folder / "storage").mkdir()
    (folder / "storage" / "__init__.py").write_text("WHO = 'user storage'\n")
    script = folder / "train.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    return script


def test_a_user_handlers_runtime_and_storage_beside_the_script_shadow_nothing(tmp_path: Path) -> None:
    """Before the import name of its own, ``from runtime import ElasticRuntime`` found the user's ``runtime.py``
    and the library's ``from handlers import ...`` the user's ``handlers.py`` (ImportError: DrainScheduler)."""
    script = write_user_folder(tmp_path)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, result = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert mine == {"mine": ["user handlers", "user runtime", "user storage"]}
    assert result == {"step": 3, "finished": [True]}


def test_the_same_folder_under_launch(tmp_path: Path) -> None:
    script = write_user_folder(tmp_path / "user")
    command = [sys.executable, "-m", "elastic_runtime.cli", "launch", "--nprocs", "2", "--steps", "3"]
    command += ["--run-dir", str(tmp_path / "run"), "--", sys.executable, str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path / "user")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ok"] is True and summary["step"] == 3
    # Every worker imported the user's own modules, and its run() returned, its RunFinished handler run (its log
    # holds what the script printed).
    [formed] = [e for e in read_events(tmp_path / "run" / "events.jsonl") if isinstance(e, GroupFormed)]
    assert len(formed.members) == 2
    for member in formed.members:  # a spare never trained: it just exits
        text = (tmp_path / "run" / "workers" / f"worker-{member}.log").read_text()
        assert '{"mine": ["user handlers", "user runtime", "user storage"]}' in text
        assert '{"step": 3, "finished": [true]}' in text
