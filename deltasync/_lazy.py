"""Exports imported on first use (PEP 562), for a package whose ``__init__`` re-exports its modules' names.

Why: importing ``deltasync`` or ``deltasync.history`` must not import torch and numba (seconds) for a
command that only lists a store, and package ``__init__`` files that import their modules eagerly make
import cycles between sibling packages (the publisher uses history's checkpoint reader, history's push
uses the publisher's writer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name ``n`` is imported from module ``homes[n]`` when first
    read, then cached in the package's namespace."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(homes))

    return __getattr__, __dir__
