"""A model in eval mode for a while: what every measurement of a model runs under, whatever mode its caller left it in
(dropout on in train mode changes every number, and differently on each run)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode inside the block; afterwards each of its modules gets back its own mode (a model some
    of whose modules were in train mode gets exactly those back), also after an exception. Modules added to the
    model inside the block keep the mode they have."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
