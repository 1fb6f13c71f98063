"""The type aliases of memprof's collectors: an op as dispatch hands it over, and the few values that are truly of
any type.

Where torch or the user hands over a value that memprof only passes on, compares or checks with ``isinstance``,
the collectors type it ``object``. The ``Any`` aliases below are the only ``Any`` of collect, cli, integrations
and the pytest plugin, each for its one reason; a value of one of them is read only where its docstring or a
comment says what it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeAlias

if TYPE_CHECKING:
    import torch
    from torch._ops import OpOverload

__all__ = ["Args", "Kwargs", "Op", "PackHook", "UnpackHook", "SavedPair", "SavedForm", "OpValue", "Row",
           "FrameworkObject"]

#: The positional and keyword arguments of a call of the user's (a module's forward, an optimizer's step, an op),
#: which memprof passes on or searches for tensors.
Args: TypeAlias = tuple[object, ...]
Kwargs: TypeAlias = dict[str, object]

#: An op as ``__torch_dispatch__`` receives it (an ``OpOverload``), with its arguments and result left open: a
#: mode only calls it, reads its schema and names, and passes its values on.
Op: TypeAlias = "OpOverload[..., object]"

#: The pack function of a saved-tensor hook pair: autograd keeps what it returns, whatever it is, and hands it to
#: the pair's unpack, which must give a tensor back (torch.autograd.graph.saved_tensors_hooks).
PackHook: TypeAlias = "Callable[[torch.Tensor], object]"
UnpackHook: TypeAlias = "Callable[[object], torch.Tensor]"
#: A pair as the saved-tensor hooks stack holds it, (pack, unpack).
SavedPair: TypeAlias = "tuple[PackHook, UnpackHook]"

#: What memprof's own pack made of a saved tensor, handed back to its unpack: a tuple (tensor, version, origin),
#: a :class:`memprof.collect.saved.Saved`, or the tensor itself. Any: torch types an unpack hook's argument so
#: (``torch._C._autograd._push_saved_tensors_default_hooks``), and the unpack tells the three forms apart by one
#: ``type()`` identity, by which mypy does not narrow; the per-save path takes no ``cast``.
SavedForm = Any

#: An argument or result of a torch function, read where the function fixes its type (a ``topk``'s first argument
#: and its indices are tensors, its ``dim`` an int). Any: torch types them so (``__torch_function__``'s
#: parameters), and a mode's path takes no check or ``cast`` (a Python call per op).
OpValue = Any

#: A small record kept as a list, so that it is written in place, and read by position: an allocation carried
#: between the allocator's windows, ``[bytes counted, category value]`` (allocation_events.Live), or a span of
#: steps, ``[first step, last step, kind]`` (carry_spans.StepSpans). Any: a list's items have one type, so the
#: numbers and the name cannot each have their own; a tuple could not be written in place.
Row = list[Any]

#: An object a training framework hands memprof's callbacks: transformers' TrainingArguments, TrainerState and
#: TrainerControl, Lightning's Trainer, and the model and optimizer they train. Any: mypy is not given lightning
#: or transformers (pyproject.toml's ignore_missing_imports), so their classes are Any to it whatever they are
#: named here; memprof reads what it needs by name with a default, and profile() checks the model and optimizers.
FrameworkObject = Any
