"""Where a module tree keeps its parameters: every name and (module, attribute) of each Parameter object."""

from __future__ import annotations

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


def param_sites(root: nn.Module, prefix: str = "") -> list[ParamSite]:
    """Every distinct Parameter under ``root`` in ``named_parameters`` order, with all its names."""
    sites: dict[int, ParamSite] = {}
    for mod_name, module in root.named_modules(prefix=prefix, remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            site = sites.setdefault(id(p), ParamSite(p))
            name = f"{mod_name}.{attr}" if mod_name else attr
            if name not in site.names:
                site.names.append(name)
            if not any(m is module and a == attr for m, a in site.locations):
                site.locations.append((module, attr))
    return list(sites.values())


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
