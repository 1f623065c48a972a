"""The import structure (issue 32): no module imports, however indirectly, a module that imports it.

A cycle makes a module's meaning depend on which of the two was imported first (a half-initialised module, an
import moved into a function to dodge it), and is the first sign that two responsibilities share a file. The
graph is grimp's (import-linter's library), built from the source: imports inside functions count, imports only
for type checkers (``if TYPE_CHECKING:``) do not.
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("deltasync", "rollout_loader", "deltasync_cli")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=True,
                             cache_dir=None)


def cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every direct import ``a -> b`` from which a chain leads back to ``a``, as the shortest such loop."""
    found = []
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            back = graph.find_shortest_chain(importer=b, imported=a)
            if back is not None:
                found.append((a, *back))
    return found


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (each an import, then the chain back to its importer):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_the_check_finds_a_cycle(graph):
    """The check itself: an import added from a low module to one that imports it is reported."""
    graph.add_import(importer="deltasync.errors", imported="deltasync.store")
    try:
        assert any(c[0] == "deltasync.errors" and c[-1] == "deltasync.errors" for c in cycles(graph))
    finally:
        graph.remove_import(importer="deltasync.errors", imported="deltasync.store")
    assert not cycles(graph)


def test_imports_inside_functions_count(graph):
    """A lazy import is still an import: the graph holds one that only a function makes (the demo's NIXL half)."""
    assert graph.direct_import_exists(importer="deltasync_cli.demo", imported="deltasync_cli.demo_nixl")
