"""Canonical tensor names: the model's own names, without the prefixes that training wrappers add.

A trainer's ``state_dict()`` names depend on how the model is wrapped: DDP adds ``module.``,
``torch.compile`` adds ``_orig_mod.``, FSDP1 and activation checkpointing add ``_fsdp_wrapped_module.`` and
``_checkpoint_wrapped_module.`` at every wrapped level. An inference engine knows only the checkpoint's
names, so a stream must carry those: the same weights publish under the same names however they were trained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from deltasync.errors import ConfigError

T = TypeVar("T")

NameMap = Callable[[str], str]

# wrappers that only ever sit at the top of a module tree; "module" may be a real submodule's name deeper down
LEADING_WRAPPERS = ("module", "_orig_mod")
# private attribute names that no model uses for itself: removed wherever they appear
ANYWHERE_WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def canonical_name(name: str, names: NameMap | None = None) -> str:
    """``name`` without wrapper prefixes, then mapped by ``names`` (a custom renaming) if given."""
    parts = name.split(".")
    lead = 0
    while lead < len(parts) - 1 and parts[lead] in LEADING_WRAPPERS:
        lead += 1
    stripped = ".".join(p for p in parts[lead:] if p not in ANYWHERE_WRAPPERS)
    if names is None:
        return stripped
    mapped = names(stripped)
    if not isinstance(mapped, str) or not mapped:
        raise ConfigError(f"names= must map a tensor name to a non-empty str; it mapped {stripped!r} to {mapped!r}")
    return mapped


def canonical_names(state_dict: Mapping[str, T], names: NameMap | None = None) -> dict[str, T]:
    """A new dict holding the same values (the same tensor objects, so tied weights stay tied) under canonical
    names, in the same order.

    Raises ``ConfigError`` when two entries end up with one name: which tensor a consumer would get is then
    undefined, so it is refused rather than one silently dropped.
    """
    out: dict[str, T] = {}
    origin: dict[str, str] = {}
    for name, value in state_dict.items():
        new = canonical_name(name, names)
        if new in out:
            raise ConfigError(
                f"tensor names {origin[new]!r} and {name!r} both become {new!r} once wrapper prefixes are removed"
                f"{' and names= is applied' if names is not None else ''}: expected one tensor per name"
            )
        out[new] = value
        origin[new] = name
    return out


def source_state(source: Any, names: NameMap | None = None) -> Mapping[str, Any]:
    """The state dict a publisher's ``source`` stands for (a module, a state dict, or a function returning
    one), under canonical names."""
    if callable(getattr(source, "state_dict", None)):
        sd = source.state_dict()
    elif callable(source):
        sd = source()
    else:
        sd = source
    return canonical_names(sd, names)
