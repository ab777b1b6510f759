"""The package layout: every package works as a program's first import, and the core stands alone."""

import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("first", ["storage", "storage.disk", "handlers", "handlers.regroup", "runtime", "runtime.cli"])
def test_each_package_works_as_the_first_import(first: str) -> None:
    out = run_python(f"import {first}\nimport runtime\nprint(runtime.ElasticRuntime.__module__)")
    assert out.strip() == "runtime.defaults.elastic"


def test_the_core_loads_no_handler_storage_or_other_runtime_layer() -> None:
    out = run_python(
        "import sys, runtime, runtime.core.runtime, runtime.core.executor\n"
        "print(sorted({m.split('.')[0] if not m.startswith('runtime.') else '.'.join(m.split('.')[:2])"
        " for m in sys.modules if m.split('.')[0] in ('runtime', 'handlers', 'storage')}))"
    )
    # runtime.compat is the layer below the core: `import runtime` loads its xla module first, to raise XLA's CPU
    # collective timeout before any backend starts (runtime/compat/xla.py).
    assert out.strip() == "['runtime', 'runtime.compat', 'runtime.core']"
