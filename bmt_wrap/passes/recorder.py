"""Eager capture: block call order recorded by forward-pre-hooks during one real (or meta) call."""

from __future__ import annotations

from types import TracebackType

from torch import nn
from torch.utils.hooks import RemovableHandle

from .discover import Discovery


class EagerRecorder:
    """Context manager recording block calls in order while the model runs once.

    Hooks go on whatever module sits at each block's FQN when entering, so it also works after blocks
    were replaced in place by executors (as long as they are called through ``__call__``).
    """

    def __init__(self, model: nn.Module, discovery: Discovery) -> None:
        self.model = model
        self.discovery = discovery
        self.order: list[str] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> EagerRecorder:
        self.order.clear()
        hooked: set[int] = set()
        for block in self.discovery.blocks:
            module = self.model.get_submodule(block.fqn)
            if id(module) in hooked:
                continue
            hooked.add(id(module))
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _args, fqn=block.fqn: self.order.append(fqn)))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
