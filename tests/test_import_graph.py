"""The import structure (issue 32): no module imports, however indirectly, a module that imports it.

A cycle makes a module's meaning depend on which of the two was imported first (a half-initialised module, an
import moved into a function to dodge it), and is the first sign that two responsibilities share a file. The
graph is grimp's (import-linter's library), built from the source: imports inside functions count, and so do
imports only for type checkers (``if TYPE_CHECKING:``): a module that must name another's class to type its own
arguments depends on it (a lower one names what it needs as a ``Protocol``: ``lease.LeaseStore``,
``watch.Watched``).
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("deltasync", "rollout_loader", "deltasync_cli")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False,
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


# the packages from the top down; an import runs down only. The exceptions, each said in a comment where it is made
LAYERS = ("deltasync_cli", "rollout_loader", "deltasync")
UPWARD = {("deltasync.__main__", "deltasync_cli")}  # `python -m deltasync` is the command line


def test_imports_run_down_the_layers(graph):
    """The library knows neither the vLLM integration nor the command line; the integration not the command line
    (issue 32: at most two imports from a lower layer to a higher one, each said in a comment)."""
    upward = []
    for low_index, low in enumerate(LAYERS):
        for high in LAYERS[:low_index]:
            for importer in sorted(m for m in graph.modules if m == low or m.startswith(low + ".")):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    if (imported == high or imported.startswith(high + ".")) and (importer, high) not in UPWARD:
                        upward.append(f"{importer} -> {imported}")
    assert upward == []
    assert len(UPWARD) <= 2
