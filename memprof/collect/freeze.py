"""Building the record: the frozen Trace from what the trackers collected, and nothing else.

The record holds measurements and the facts a formula will need (each module
call's shapes and configuration, each optimizer's groups and parameters),
never a formula's result: predicting is :mod:`memprof.anatomy.predict`'s job,
downstream. What a run could not measure is ``None`` in every breakdown, and
the notes say why.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import is_interrupt
from ..version import __version__
from ..record.trace import (Breakdown, ModelFacts, ModuleRecord, OomRecord, OperationRecord, Sample, StepRecord,
                            Trace, parent_path)
from .ledger import ACTIVATIONS, CATEGORY_OF_INDEX, INPUTS, TEMPORARIES, Ledger, breakdown, storage_of, tag_pairs
from .module_table import attribute_tensors
from ..vocabulary import Phase
from .phase_records import finish
from .phases import MAX_DECODE_PHASES
from .state import EXACT, LIGHT

if TYPE_CHECKING:
    from ..record.parts import RankInfo
    from .device import DeviceReading
    from .wiring import Collectors

__all__ = ["AtError", "breakdown", "blank", "blank_step", "build_trace", "latest_recorded", "unmeasured",
           "live_modules", "live_storages"]

#: Most live storages an error's record lists (the largest): bounds a dump of a model of any size.
MAX_LIVE_STORAGES = 100_000


def blank(bd: Breakdown, cats: frozenset[int], total: bool) -> Breakdown:
    """``bd`` with the categories a run could not measure (and maybe its total) as None."""
    counts = tuple(None if i in cats else v for i, v in enumerate(bd.counts))
    return Breakdown(counts, None if total else bd.total)


def blank_step(step: StepRecord, cats: frozenset[int], total: bool) -> StepRecord:
    """``step`` with what the run could not measure as None in each phase's start, peak and end."""
    return dataclasses.replace(step, phases=tuple(
        dataclasses.replace(p, start=blank(p.start, cats, total), peak=blank(p.peak, cats, total),
                            end=blank(p.end, cats, total)) for p in step.phases))


@dataclasses.dataclass
class AtError:
    """What an error that ended the block left: its description, what was live then (by category, by creating
    module, storage by storage), and an out-of-memory error's record."""

    error: "str | None" = None
    live: "Breakdown | None" = None
    live_modules: tuple[tuple[str, int], ...] = ()
    live_storages: tuple[tuple[int, int, str, str], ...] = ()
    oom: "OomRecord | None" = None


def latest_recorded(c: "Collectors") -> "StepRecord | None":
    """The last step recorded so far (``None`` before the first), with what the run cannot measure as None, as
    the trace will have it: a callback never logs a figure the report calls not measured."""
    kept = c.phases.retention.kept
    if not kept:
        return None
    missing = unmeasured(c)
    last = kept[max(kept)]
    return blank_step(last, *missing) if missing is not None else last


def live_modules(c: "Collectors") -> tuple[tuple[str, int], ...]:
    """Bytes of live storages created while each module was innermost (at an error)."""
    by_module: dict[int, int] = {}
    c.ledger.settle()
    for entry in c.ledger.entries.values():
        if entry.cat in (ACTIVATIONS, TEMPORARIES) and entry.module >= 0:
            by_module[entry.module] = by_module.get(entry.module, 0) + entry.nbytes
    ranked = sorted(by_module.items(), key=lambda kv: -kv[1])
    return tuple((c.table.path(i), n) for i, n in ranked[:20])


def live_storages(c: "Collectors") -> tuple[tuple[int, int, str, str], ...]:
    """Each live storage's address, bytes, category and creating module (at an error), largest first:
    a memory_viz snapshot taken then is attributed by these addresses."""
    if c.storages.fake_mode is not None:
        return ()  # a simulation's storages have no addresses (a fake tensor's data pointer only warns)
    info = c.table.info
    out = []
    c.ledger.settle()
    for entry in c.ledger.entries.values():
        storage = entry()  # the entry is a weak reference to its storage
        if storage is None:
            continue
        try:
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            continue
        if not ptr:
            continue
        module = (info[entry.module].path or "<model>") if 0 <= entry.module < len(info) else ""
        out.append((ptr, entry.nbytes, CATEGORY_OF_INDEX[entry.cat].value, module))
    out.sort(key=lambda s: -s[1])
    return tuple(out[:MAX_LIVE_STORAGES])


def build_trace(c: "Collectors", at_error: "AtError | None" = None) -> Trace:
    """The record of the run so far (at the end of a schedule's window) or of the whole run, with what an
    error that ended it left."""
    at_error = at_error if at_error is not None else AtError()
    run = c.run
    c.params.resync_storages()  # the parameters as they are at the end (settles what torch released)
    led = c.ledger
    light = run.mode == LIGHT
    steps = finish(c.phases)
    start, peak, end, peak_step, peak_where = _run_figures(c, steps, c.probe.finish(), light)
    peak_module = None
    if not light and 0 <= led.peak_module < len(c.table.info):
        peak_module = c.table.path(led.peak_module)
    # Before the notes are read: it notes an optimizer it cannot record. FSDP1's flat parameters are recorded by
    # the parameters they hold, whole, as FSDP2's DTensors are (the formula is the model's, the rank's share after).
    optimizers = c.optimizers.specs(c.flat.whole_shapes() if c.flat is not None else None)
    notes = _notes(c, steps)
    carried = c.carry.spans.record() if c.carry is not None else ()
    micros = c.timeline.micros
    timeline = tuple(Sample(seq, step, phase, label, breakdown(list(totals), light=light, where="sample"),
                            micros(ns), event)
                     for seq, step, phase, label, totals, ns, event in c.timeline.samples)
    live_at_error = at_error.live
    missing = unmeasured(c)
    if missing is not None:
        start, peak, end = (blank(b, *missing) for b in (start, peak, end))
        steps = [blank_step(s, *missing) for s in steps]
        timeline = tuple(dataclasses.replace(x, breakdown=blank(x.breakdown, *missing)) for x in timeline)
        if live_at_error is not None:
            live_at_error = blank(live_at_error, *missing)
    operations = c.storages.operations
    return Trace(
        mode=EXACT if run.source == "allocator" else run.mode,
        device=dataclasses.replace(c.probe.info(), rounding=led.rounding),
        torch_version=torch.__version__,
        memprof_version=__version__,
        start=start,
        peak=peak,
        end=end,
        peak_step=peak_step,
        peak_phase=peak_where[1] if peak_where else None,
        peak_module=peak_module,
        steps=tuple(steps),
        modules=module_records(c),
        timeline=timeline,
        notes=tuple(dict.fromkeys(notes)),
        error=at_error.error,
        live_at_error=live_at_error,
        live_modules_at_error=at_error.live_modules,
        optimizer=c.optimizers.class_name,
        optimizer_implementation=c.optimizers.implementation,
        param_dtypes=c.param_dtypes,
        autocast_dtype=c.storages.autocast_dtype,
        generation=c.kv.formula.facts(),
        distributed=_rank(c),
        routing=c.routing.record() if c.routing is not None else None,
        optimizer_steps=carried,
        peak_tags=tag_pairs(led.peak_tags),
        facts=model_facts(c),
        operations=tuple(
            OperationRecord(phase, cls, op, *vals) for (phase, cls, op), vals in sorted(operations.rows.items())
        ) if operations is not None else None,
        module_calls=tuple(call for _index, call in c.capture.module_calls),
        optimizers=optimizers,
        num_steps=c.phases.retention.steps_run,
        phase_stats=c.phases.retention.phase_stats(),
        schedule=c.schedule.describe() if c.schedule is not None else None,
        recorded_steps=c.windows.recorded_steps() if c.windows is not None else (),
        oom=at_error.oom,
        live_storages_at_error=at_error.live_storages,
    )

#: A run's start, peak and end, the step that held the peak, and (step, phase) where it was.
_RunFigures = tuple[Breakdown, Breakdown, Breakdown, "int | None", "tuple[int, Phase] | None"]


def _run_figures(c: "Collectors", steps: "list[StepRecord]", device_now: "DeviceReading | None", light: bool
                 ) -> _RunFigures:
    """The run's start, peak and end, and the step and phase that held the peak: the ledger's (the device's
    figures at the peak are those of the phase that held it), or the allocator's windows'."""
    led = c.ledger
    end = breakdown(led.totals, light=light, where="end", device=device_now)
    start = breakdown(c.start_totals, light=light, where="start")
    peak_where = c.phases.where.get(led.peak_phase_serial)
    peak_step = peak_where[0] if peak_where else None
    if peak_step is not None and steps and peak_step > steps[-1].index:
        peak_step = steps[-1].index
    peak_device = None
    for s in steps:
        for p in s.phases:
            if peak_where and s.index == peak_where[0] and p.phase is peak_where[1] and p.peak.total is not None:
                peak_device = p.peak
    peak = breakdown(led.peak, light=light, where="peak", device=c.probe.global_peak())
    if peak_device is not None and not light:
        n = len(CATEGORY_OF_INDEX)
        peak = Breakdown(peak.counts[:n] + peak_device.counts[n:],
                         sum(v or 0 for v in peak.counts[:n]) + sum(v or 0 for v in peak_device.counts[n:]))
    src = c.allocator
    figures = src.figures(device_now, c.probe.global_peak()) if src is not None else None
    if figures is not None:  # source="allocator": the run's figures are its windows'
        start, peak, end, peak_step, peak_name = figures
        peak_where = (peak_step, Phase(peak_name))
    return start, peak, end, peak_step, peak_where


def _notes(c: "Collectors", steps: "list[StepRecord]") -> list[str]:
    """What the record says about itself: the run's notes, the device's, coverage, and the collectors'."""
    notes = list(c.run.notes) + c.probe.notes() + coverage_notes(c)
    if c.phases.merged_decodes:
        notes.append(f"{c.phases.merged_decodes} further decode calls joined the {MAX_DECODE_PHASES}th decode "
                     "phase of their generation (its peak is theirs, its end the last one's)")
    if not steps:
        notes.append("nothing ran inside the profile: no forward, backward or optimizer step was seen")
    if c.carry is not None:
        notes.extend(c.carry.spans.notes())
    return notes



def _rank(c: "Collectors") -> "RankInfo | None":
    """The rank's record; with FSDP2 or FSDP1, with the sharded and unsharded bytes its tracker measured at the
    end."""
    if c.flat is not None:
        return c.flat.rank
    return c.shards.rank if c.shards is not None else c.rank


def unmeasured(c: "Collectors") -> "tuple[frozenset[int], bool] | None":
    """Categories (and whether the total) this run could not measure, or None when it measured all."""
    cats: set[int] = set()
    total = False
    if c.run.foreign_threads:
        # The dispatch mode and saved-tensor hooks are per thread: ops and saves there were not seen.
        cats |= {ACTIVATIONS, INPUTS, TEMPORARIES}
        total = c.run.mode == EXACT
    if c.saved.hooks.in_transform:
        # Saved there or not cannot be told apart: torch.func allows no saved-tensor hooks.
        cats |= {ACTIVATIONS, TEMPORARIES}
    if c.params.invisible_forwards or c.saved.unreadable:
        cats |= {ACTIVATIONS}
    return (frozenset(cats), total) if cats else None


def coverage_notes(c: "Collectors") -> list[str]:
    """What this run could not see, or saw only in part, in the words the report prints."""
    notes = []
    run, table = c.run, c.table
    exact = run.mode == EXACT
    if run.foreign_threads:
        notes.append(
            f"the model ran in {len(run.foreign_threads)} thread(s) other than the one that started the "
            "profile, where memprof's dispatch mode and saved-tensor hooks (both per thread) are not "
            "installed: activations, inputs, temporaries" + (" and the total" if exact else "")
            + " are not measured, in the breakdowns and per module; start the profile in the thread that trains")
    hooks = c.saved.hooks
    if hooks.in_transform:
        notes.append(
            f"the model ran {hooks.in_transform} time(s) inside torch.func transforms (grad, vjp, "
            "jacrev, hessian), where torch allows no saved-tensor hooks: what autograd saved there cannot "
            "be told from temporaries, so activations and temporaries are not measured")
    if c.params.invisible_forwards:
        notes.append(
            "the model's parameters got gradients from a forward memprof's module hooks did not see (a "
            "torch.compile wrapper of this model was called, whose compiled code skips the hooks of the "
            "module it wraps, or the forward ran before the profile): activations are not measured; profile "
            "the module you call, memprof.profile(compiled_model, optimizer)")
    if c.params.compiled_backwards:
        notes.append(
            f"{c.params.compiled_backwards} backward(s) made gradients that memprof's gradient hooks did not see "
            "(compiled autograd ran them, and it traces hooks into its graph, where memprof's do nothing, so as not "
            "to change it): those gradients were found at the next forward or optimizer step, where each such "
            "backward phase ends, and counted as gradients at their backward's peak from when they were made; the "
            "per-module backward columns of those backwards are not measured")
    if hooks.chained_to:
        names = ", ".join(sorted(hooks.chained_to))
        notes.append(
            f"saved_tensors_hooks of your own were active ({names}): memprof ran them as without it and "
            f"counted as activations the tensors on {run.device.type} that their pack returned"
            + ("" if exact else "; tensors saved under them outside the model's modules (a loss "
               "computed inside such a block) are not seen in light mode"))
    if table.skipped_paths:
        where = ", ".join(table.skipped_paths[:3]) + (" ..." if len(table.skipped_paths) > 3 else "")
        notes.append(
            f"calls of {where} ran none of their submodules' hooks (a torch.compile wrapper of the model "
            "ran them from compiled code, or they called submodules through .forward()): those submodules "
            "have no per-module figures, and what the calls saved counts as their activations; to see "
            "inside, profile the compiled wrapper itself (memprof.profile(compiled_model, optimizer))")
    if table.compiled_paths:
        where = ", ".join(table.compiled_paths[:3]) + (" ..." if len(table.compiled_paths) > 3 else "")
        notes.append(
            f"{table.compiled_calls} call(s) ran torch.compile'd code ({where}): memprof saw what the "
            "compiled code returned and what autograd saved from it, not the scratch memory its kernels "
            "use inside, so temporaries and peaks inside those calls are lower bounds and per-module "
            "figures stop at the compiled module")
    if run.changes:
        notes.append("the model or its optimizer changed during profiling (" + "; ".join(run.changes)
                     + "): figures before that count what existed then")
    return notes


def module_records(c: "Collectors") -> tuple[ModuleRecord, ...]:
    """Each module's row. A figure the run could not measure is None in every row, as in the breakdowns:
    saved activations when activations are not measured, peaks and scratch memory when the total is not
    (ops of another thread, say, were not seen: a maximum over the calls that were would be a lower bound)."""
    led = c.ledger
    table = c.table
    missing = unmeasured(c)
    no_activations = missing is not None and ACTIVATIONS in missing[0]
    no_peaks = missing is not None and missing[1]
    records = []
    for i, info in enumerate(table.info):
        params = 0
        grads = 0
        seen: set[int] = set()
        for ref in table.params[i]:
            p = ref()
            if p is None:
                continue
            params += _storage_bytes(p, seen, led)
            if p.grad is not None:
                grads += _storage_bytes(p.grad, seen, led)
        full = c.run.mode == EXACT and i not in table.unhooked and not no_peaks
        records.append(ModuleRecord(
            path=info.path or "<model>",
            type=info.type,
            parameters=params,
            gradients=grads,
            activations=None if i in table.unhooked or no_activations else info.act_bytes,
            peak_forward=info.fwd_peak if full else None,
            peak_backward=info.bwd_peak if full else None,
            temporaries_forward=info.fwd_tmp if full else None,
            temporaries_backward=info.bwd_tmp if full else None,
            calls=info.calls,
        ))
    # Recursive activation totals: a container holds what its children saved.
    own = {m.path: m.activations or 0 for m in records}
    totals: dict[str, "int | None"] = {m.path: m.activations for m in records}
    for m in records:
        if m.path == "<model>" or m.activations is None:
            continue
        path = m.path
        while True:
            path = parent_path(path)
            key = path or "<model>"
            if totals.get(key) is not None:
                totals[key] = totals[key] + own[m.path]  # type: ignore[operator]  # not None: tested above
            if not path:
                break
    first_inputs: dict[int, int] = {}
    for index, call in c.capture.module_calls:
        first_inputs.setdefault(index, sum(t.nbytes for t in call.inputs))
    row = {(info.path or "<model>"): i for i, info in enumerate(table.info)}
    return tuple(dataclasses.replace(m, activations=totals[m.path], own_activations=m.activations,
                                     input_bytes=first_inputs.get(row[m.path])) for m in records)


def model_facts(c: "Collectors") -> ModelFacts:
    """Model figures the reconciler needs, measured on the live objects at exit."""
    led = c.ledger
    params = c.params.live()
    trainable = [p for p in params if p.requires_grad]
    model = c.table.root_ref()
    buffers = 0
    if model is not None:
        seen: set[int] = set()
        for b in model.buffers():
            buffers += _storage_bytes(b, seen, led)
        for mod in model.modules():
            for t in attribute_tensors(mod):
                if t.device == c.run.device:
                    buffers += _storage_bytes(t, seen, led)
    seen = set()
    weight_bytes = sum(_storage_bytes(p, seen, led) for p in params)
    seen = set()
    trainable_bytes = sum(_storage_bytes(p, seen, led) for p in trainable)
    dims: list[tuple[str, str, int]] = []
    for i, info in enumerate(c.table.info):
        module = c.table.refs[i]()
        if not isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
            continue
        for attr in ("in_features", "out_features", "in_channels", "out_channels", "num_embeddings",
                     "embedding_dim"):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                dims.append((info.path or "<model>", attr, value))
    calls = c.capture.module_calls
    batch = None
    root = next((call for index, call in calls if index == 0), None)
    if root is not None and root.inputs and root.inputs[0].shape:
        batch = root.inputs[0].shape[0]
    num_params, num_trainable = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    if c.flat is not None:  # FSDP1's flat parameters hold this rank's shard: the model's counts are the whole
        num_params, num_trainable = c.flat.counts(params)
    return ModelFacts(
        dims=tuple(dims),
        batch_size=batch,
        num_params=num_params,
        num_trainable=num_trainable,
        trainable_tensors=len(trainable),
        weight_bytes=weight_bytes,
        trainable_bytes=trainable_bytes,
        buffer_bytes=buffers,
        activation_inputs_saved=sum(c.saved.saved_inputs.values()) if calls else None,
    )


def _storage_bytes(t: torch.Tensor, seen: set[int], led: Ledger) -> int:
    st = storage_of(t)
    if st is None or st._cdata in seen:
        return 0
    seen.add(st._cdata)
    return led.size_of(st.nbytes())
