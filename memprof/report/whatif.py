"""The what-if of a measured run (``Report.what_if``): the changed run simulated, with its text."""

from __future__ import annotations

from typing import Any

from ..simulate import whatif
from .device import on_device
from .wrap import promote, same_as

__all__ = ["WhatIf", "what_if"]


class WhatIf(whatif.WhatIf):
    __doc__ = whatif.WhatIf.__doc__

    def to_text(self) -> str:
        """The change, the measured and the predicted breakdowns at their peaks and the saving per category, then
        the notes: what ``print()`` shows."""
        from ..render.plan import what_if_text

        return what_if_text(self)

    def __str__(self) -> str:
        return self.to_text()


@same_as(whatif.what_if)
def what_if(trace: Any, model: Any, optimizer: Any = None, **options: Any) -> WhatIf:
    from ..record.trace import as_trace

    data = whatif.what_if(as_trace(trace), model, optimizer, **options)
    return promote(WhatIf, data, device_memory=on_device(data.device_memory))
