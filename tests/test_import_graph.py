"""The import graph has no circle but the one issue 61 is to take apart, and none grows: a module that imports
one that imports it back (directly or through others, TYPE_CHECKING imports included) makes both harder to read,
test and change. Counted with grimp, import-linter's graph."""

from __future__ import annotations

import grimp

# The circle left, the modules of one object split into free functions over it (issue 61): the controller's shell
# and its parts. It may not grow, and no other may appear (before this wave: 5, with core.context <-> core.runtime,
# controller.connection <-> processes, the supervisor and the worker's loop with their parts, whose state moved
# below them: controller/supervisor_state.py, worker/state.py).
ALLOWED = [
    {"elastic_runtime.cluster.controller", *(f"elastic_runtime.cluster.controller.{m}" for m in (
        "actions", "admission", "commits", "context", "drain", "ending", "messages", "relay", "shell", "workers"))},
]  # fmt: skip


def circles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle_but_the_one_being_taken_apart_and_none_grows() -> None:
    graph = grimp.build_graph("elastic_runtime", include_external_packages=False)
    found = circles(graph)
    unexpected = [sorted(c) for c in found if not any(c <= allowed for allowed in ALLOWED)]
    assert not unexpected, f"new import circles: {unexpected}"
    assert len(found) <= len(ALLOWED)


def test_a_circle_is_found() -> None:
    """The check itself: a circle added to a graph is found (so the test above can fail)."""
    graph = grimp.build_graph("elastic_runtime", include_external_packages=False)
    graph.add_import(importer="elastic_runtime.core.events", imported="elastic_runtime.core.bus")
    assert {"elastic_runtime.core.events", "elastic_runtime.core.bus"} <= set().union(*circles(graph))
