"""The type aliases of memprof's simulation (memprof/simulate/): the few values that are truly of any type, each
named once with its one reason, so that ``Any`` appears nowhere else in the simulation's modules.

Everything else a simulation handles has its type: a tensor, a module, an optimizer, an op (torch's
``OpOverload``), memprof's own classes; a user's function is a ``Callable`` of what memprof calls it with; a value
only passed on or compared is ``object``. The aliases below are for what no type describes better than Any: what
torch itself types Any, a user's value handed to the user's own code, an object of a library mypy has no types
for. Nothing here is imported at run time but the names (importing memprof imports no torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpValue", "UserValue", "Library", "HfModule", "HfConfig", "Option", "FileValue", "HfCache"]

# --- aliases of the run's description, the kernels, the loops and the pipeline (anysa) ---

#: An argument of a torch function or op as a mode's handler receives it, or what the handler hands back:
#: torch's ``TorchFunctionMode.__torch_function__`` and ``TorchDispatchMode.__torch_dispatch__`` type them Any, and
#: each is what the op's schema says (a tensor, a number, a list of sizes, None): the rule that reads one knows
#: from the op it handles which it is.
OpValue = Any

#: A value of the user's, of whatever type their own code takes or gives: a model's inputs and targets (a tensor,
#: a tuple of arguments, a dict of keyword arguments, any pytree), what the model, a loss or a step function
#: returns. memprof hands it to the user's code or to torch, which decide what it may be, and reads it only by
#: duck typing (isinstance, getattr) where it reads it.
UserValue = Any

#: An object of an optional library that memprof calls by the attributes the installed version has, of a class
#: mypy has no types for: accelerate's (it ships none), and the small shell classes built at run time with
#: ``type()`` from the functions of accelerate's ``Accelerator`` and transformers' ``Trainer``
#: (memprof.simulate.loops), whose attributes are the installed version's.
Library = Any

#: A transformers model (an ``nn.Module`` of one of transformers' classes), read by the attributes its architecture
#: has (``base_model.layers``, ``lm_head``, ``config.vocab_size``, ``loss_function``, ``pp_plan``): they are its
#: own class's, not ``PreTrainedModel``'s or ``nn.Module``'s (whose ``__getattr__`` says tensor or module), and are
#: checked where they are read (memprof.simulate.hf_pipeline.pp_support).
HfModule = Any

#: A transformers config (a ``PretrainedConfig`` of the model's type) as transformers gives it: its own
#: ``AutoConfig.from_pretrained`` returns Any, and a config's fields are its model type's (``num_hidden_layers``,
#: ``layer_types``, ``rope_scaling``), which ``PretrainedConfig`` types Any too; memprof checks each where it reads
#: it (memprof.simulate.hf_limits). A function that only takes a config takes a ``PretrainedConfig``.
HfConfig = Any

#: A keyword argument of ``estimate()`` or ``estimate_generation()`` as the user gave it, handed on to the section
#: of :class:`~memprof.simulate.run.RunConfig` that takes it (``RunConfig.from_options``): the section's field
#: says its type, and the section checks it as it is made, with an error naming the keyword.
Option = Any

#: A value of a run file after its key's check (memprof.simulate.run_file): its key says its type (``batch_size``
#: an int, ``gpu`` a str, ``mesh`` a dict of sizes), and its reader (the command line's ``--config``) reads it by
#: its key; a union would make each reader narrow what the key already says.
FileValue = Any

# --- aliases of the ranks, the allocator stream and the twin (anysb) ---

#: A transformers cache as a model keeps it across decoding calls (``DynamicCache``, ``EncoderDecoderCache``, or
#: whatever a model returns as ``past_key_values``), read by the attributes its version has (``layers``,
#: ``update``, ``reorder_cache``, ``self_attention_cache``): transformers is not given to mypy (pyproject.toml's
#: ignore_missing_imports), and the attributes are checked where they are read (memprof.simulate.decoding).
HfCache = Any
