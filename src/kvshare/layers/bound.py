"""`BoundOp`: a layer whose implementation is chosen once (`bind`), never per call."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from kvshare.layers.choice import KernelChoice


class BoundOp(nn.Module):
    """Base of a layer with a torch reference (`forward_torch`) and other implementations.

    Subclasses implement `forward_torch` (the reference the tests compare with) and override
    `select(choice)` to return the bound method that serves `choice`. `forward` calls what `bind`
    chose; a freshly built layer is bound to the reference. Invariant: `self.impl` is one of the
    subclass's own ``forward_*`` methods, picked by `select` from the last `bind`'s choice.
    """

    choice: KernelChoice

    def __init__(self) -> None:
        super().__init__()
        self.bind(KernelChoice.reference())

    def bind(self, choice: KernelChoice) -> None:
        """Choose this layer's implementation for `choice` (see `select`)."""
        self.choice = choice
        self.impl: Callable[..., Any] = self.select(choice)

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        """The implementation that serves `choice` (default: the torch reference, which every
        subclass defines as ``forward_torch``)."""
        return self.forward_torch  # type: ignore[attr-defined]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(*args, **kwargs)


def bind_model(model: nn.Module, choice: KernelChoice) -> None:
    """Bind every module of `model` (itself included) that chooses an implementation to `choice`:
    each `BoundOp`, and each module that, like `layers.linear.Linear`, keeps its own base class and
    defines ``bind``. (A model whose own ``bind`` calls this passes its submodules.)"""
    for m in model.modules():
        if callable(getattr(type(m), "bind", None)):
            m.bind(choice)
