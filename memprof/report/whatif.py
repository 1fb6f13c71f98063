"""The what-if of a measured run (``Report.what_if``): the changed run simulated, a
:class:`~memprof.record.estimate.WhatIf` record whose text is the view :mod:`.views` registers."""

from __future__ import annotations


from ..record.estimate import WhatIf
from ..simulate import whatif
from .wrap import same_as, Forwarded

__all__ = ["WhatIf", "what_if"]


@same_as(whatif.what_if)
def what_if(trace: Forwarded, model: Forwarded, optimizer: Forwarded = None, **options: Forwarded) -> WhatIf:
    from ..record.trace import as_trace

    return whatif.what_if(as_trace(trace), model, optimizer, **options)
