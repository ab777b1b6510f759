"""The import graph has no circle: a module that imports one that imports it back (directly or through others,
TYPE_CHECKING imports included) makes both harder to read, test and change. Counted with grimp, import-linter's
graph. Before issue 61 there were 5: core.context <-> core.runtime, controller.connection <-> processes, and three
objects split into modules of free functions over them (the controller's shell, the supervisor, the worker's loop),
each part importing the object back; their state now lives below their parts (controller/state.py,
controller/supervisor_state.py, worker/state.py)."""

from __future__ import annotations

import grimp


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


def test_no_import_circle() -> None:
    graph = grimp.build_graph("elastic_runtime", include_external_packages=False)
    assert [sorted(c) for c in circles(graph)] == []


def test_a_circle_is_found() -> None:
    """The check itself: a circle added to a graph is found (so the test above can fail)."""
    graph = grimp.build_graph("elastic_runtime", include_external_packages=False)
    graph.add_import(importer="elastic_runtime.core.events", imported="elastic_runtime.core.bus")
    assert {"elastic_runtime.core.events", "elastic_runtime.core.bus"} <= set().union(*circles(graph))
