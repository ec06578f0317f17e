"""Where a module tree keeps its parameters: every name and (module, attribute) of each Parameter object,
and the one way to put other tensors there for a while."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..base.dtypes import dtype_name
from ..base.plan import ParamInfo

Location = tuple[nn.Module, str]


@dataclass
class ParamSite:
    """One Parameter object and every place it is registered (several for tied weights)."""

    param: nn.Parameter
    names: list[str] = field(default_factory=list)
    locations: list[Location] = field(default_factory=list)

    def info(self) -> ParamInfo:
        """Layout input for this parameter (canonical name = first name)."""
        shape = list(getattr(self.param, "full_shape", self.param.shape))
        return ParamInfo(fqn=self.names[0], shape=shape, dtype=dtype_name(self.param.dtype),
                         requires_grad=self.param.requires_grad, aliases=self.names[1:])


def registrations(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """Each registered parameter under ``root`` as (name, module, attribute, parameter), tied names included,
    in ``named_modules(remove_duplicate=False)`` order."""
    for mod_name, module in root.named_modules(prefix=prefix, remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                yield (f"{mod_name}.{attr}" if mod_name else attr), module, attr, p


def param_sites(root: nn.Module, prefix: str = "") -> list[ParamSite]:
    """Every distinct Parameter under ``root`` in ``named_parameters`` order, with all its names."""
    sites: dict[int, ParamSite] = {}
    for name, module, attr, p in registrations(root, prefix):
        site = sites.setdefault(id(p), ParamSite(p))
        if name not in site.names:
            site.names.append(name)
        if not any(m is module and a == attr for m, a in site.locations):
            site.locations.append((module, attr))
    return list(sites.values())


def put(entries: Iterable[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Register each tensor at its (module, attribute). Through ``_parameters``, not ``__setattr__``: a plain
    tensor (a gathered view, a full temporary) stands where the Parameter is while a block runs."""
    for module, attr, t in entries:
        module._parameters[attr] = t


@contextmanager
def installed(entries: Iterable[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    """``put`` the tensors for the duration; then what was registered before is back."""
    entries = list(entries)
    saved = [(module, attr, module._parameters[attr]) for module, attr, _ in entries]
    put(entries)
    try:
        yield
    finally:
        put(saved)


def check_single_device(sites: list[ParamSite], what: str) -> torch.device:
    """The one device all parameters share (meta counts as any); raises naming two that differ."""
    from ..errors import WrapError

    device: torch.device | None = None
    first = ""
    for s in sites:
        d = s.param.device
        if d.type == "meta":
            continue
        if device is None:
            device, first = d, s.names[0]
        elif d != device:
            raise WrapError(f"{what} has parameters on different devices: {first!r} on {device} and "
                            f"{s.names[0]!r} on {d}. Move the model to one device before wrapping "
                            "(model.to(device)).")
    return device or torch.device("cpu")
