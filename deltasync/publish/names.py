"""Canonical tensor names: the model's own names, without the prefixes that training wrappers add.

A trainer's ``state_dict()`` names depend on how the model is wrapped: DDP adds ``module.``,
``torch.compile`` adds ``_orig_mod.``, FSDP1 and activation checkpointing add ``_fsdp_wrapped_module.`` and
``_checkpoint_wrapped_module.`` at every wrapped level. An inference engine knows only the checkpoint's
names, so a stream must carry those: the same weights publish under the same names however they were trained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

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
    one), under canonical names. A transformers model publishes under its *checkpoint* names
    (:func:`checkpoint_state`)."""
    if callable(getattr(source, "state_dict", None)):
        sd = checkpoint_state(source)
    elif callable(source):
        sd = source()
    else:
        sd = source
    return canonical_names(sd, names)


def checkpoint_state(module: Any) -> Mapping[str, Any]:
    """``module.state_dict()``, in the layout ``save_pretrained`` writes when ``module`` is a transformers model.

    transformers 5 holds some weights fused in memory (a MoE layer's ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj``) while its checkpoints, and so every inference engine, keep one tensor per expert
    (``experts.{e}.gate_proj.weight``...). The conversion is transformers' own (``revert_weight_conversion``,
    what ``save_pretrained`` applies), so the stream's names and shapes are the serving checkpoint's. Sharded
    (DTensor) fused weights are refused: splitting them would gather them on every rank.
    """
    sd = module.state_dict()
    if not type(module).__module__.startswith("transformers."):
        return sd
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(module, sd)
    if set(out) == set(sd):
        return sd  # nothing held fused: the module's own tensors (tied ones stay recognisably tied)
    if any(type(t).__name__ == "DTensor" for t in sd.values()):
        changed = sorted(set(sd) - set(out))[:3]
        raise ConfigError(f"{changed} are held fused by transformers and saved split; splitting sharded (FSDP2) "
                          "tensors is not supported: publish from a model whose experts are not fused, or pass a "
                          "state dict in checkpoint layout as source")
    # the conversion may copy what it does not split: keep the module's own tensor where a name is unchanged, so
    # tensors sharing storage (a tied head) are still published once, under the module's first name
    kept = {n: sd[n] for n in sd if n in out and sd[n].shape == out[n].shape}
    return {**kept, **{n: t for n, t in out.items() if n not in kept}}


def named_tensors(source: Any, names: NameMap | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The trainer's tensors by canonical name (wrapper prefixes such as DDP's ``module.`` removed, then
    ``names`` applied), and aliases (names sharing storage with an earlier name, e.g. tied embeddings),
    which are published once under their first name.
    """
    sd = source_state(source, names)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
    return tensors, aliases
