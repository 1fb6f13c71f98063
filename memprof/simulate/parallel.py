"""One rank of the user's own parallelize function, simulated: ``estimate(..., world_size=N, parallelize=fn)``.

The user's function is ``fn(model, mesh) -> model`` (or ``None`` when it parallelised ``model`` in place, as
``fully_shard`` does). It is the function their training script calls: it applies ``fully_shard`` (with its
``MixedPrecisionPolicy``, ``OffloadPolicy``, ``reshard_after_forward``, prefetching, a 2-D mesh for HSDP),
``parallelize_module`` (colwise, rowwise, ``SequenceParallel``, ...) with their own arguments. memprof hands
it a ``DeviceMesh`` of the shape the estimate is asked for, on torch's fake process group
(``torch/testing/_internal/distributed/fake_pg.py``: collectives return at once and move nothing), as rank
``rank`` of ``world_size``. torchtitan's memory estimator does the same for FSDP
(``scripts/estimate/estimation.py``: fake process group, ``FakeTensorMode``).

The steps, in order (each needed; the notes of the estimate say so):

1. The fake process group, and the mesh on it: built outside any fake mode, since mesh code reads the
   mesh's tensors (``mesh["tp"]``, and ``fully_shard(reshard_after_forward=int)`` builds a mesh from
   ``mesh.mesh.view(...).tolist()``).
2. ``fn`` runs on the model's twin on the ``meta`` device, also outside the fake mode; then the twin is
   materialised as fake CPU tensors (``to_empty``), the way torchtitan initialises a model.
3. While the step runs, three rules that a run on real tensors does not need:

   - ``_c10d_functional.wait_tensor`` returns its input, as it does in eager; its meta kernel
     (``torch/distributed/_functional_collectives.py``, ``_wait_tensor_meta``) allocates a copy, which no real
     run has.
   - DTensor's sharding propagation computes output shapes on fake tensors of the *global* shape
     (``torch/distributed/tensor/_sharding_prop.py``, ``_propagate_tensor_meta_non_cached``); it takes the
     fake mode it finds active, the simulation's, so those would count as temporaries. It is given a fake
     mode of its own, whose tensors the profiler knows are metadata.
   - After the rank, the process group is destroyed and DTensor's sharding caches cleared
     (``torch.distributed.tensor.debug._clear_sharding_prop_cache``): a mesh's hash ignores the rank, so the
     next rank would otherwise be handed this one's process groups.

Everything else is FSDP2's and DTensor's own code, as the user configured it: nothing is replayed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import sys
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..errors import InvalidArgumentError, MemprofError, is_interrupt
from ..vocabulary import Category
from .fsdp1 import fsdp1_in_fake_mode, fsdp1_notes, has_meta, unwrapped
from .op_chain import OpRule

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh

    from ..record.trace import Trace
    from .aliases import OpValue, UserValue
    from .op_chain import OpNext
    from .pipeline import Pipeline, PipelineStep, StageSet
    from .run import MeshSizes

_W, _O = Category.WEIGHTS, Category.OPTIMIZER_STATES

__all__ = ["ParallelRun", "WaitIdentity", "check_mesh"]

#: DTensor's table of ops it hands to handlers of its own (context parallelism adds one for attention).
_Handlers = dict[torch._ops.OpOverload, Callable[..., object]]


def check_mesh(mesh: "MeshSizes | None", world_size: int) -> "tuple[tuple[int, ...], tuple[str, ...] | None]":
    """The mesh's shape and dimension names: ``None`` (one dimension of ``world_size``), a tuple of sizes, or a
    dict ``{name: size}`` in mesh order; the sizes multiply to ``world_size``."""
    if mesh is None:
        return (world_size,), None
    if isinstance(mesh, dict):
        names: "tuple[str, ...] | None" = tuple(str(k) for k in mesh)
        sizes = tuple(mesh.values())
    elif isinstance(mesh, (tuple, list)):
        names, sizes = None, tuple(mesh)
    else:
        raise InvalidArgumentError(f"mesh must be a tuple of sizes or a dict {{name: size}}, got {type(mesh).__name__}")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in sizes):
        raise InvalidArgumentError(f"mesh sizes must be positive ints, got {mesh!r}")
    if math.prod(sizes) != world_size:
        raise InvalidArgumentError(f"the mesh {mesh!r} has {math.prod(sizes):,} ranks, but world_size is "
                                   f"{world_size:,}: its sizes must multiply to the world size")
    return tuple(int(s) for s in sizes), names


class WaitIdentity(OpRule):
    """``_c10d_functional.wait_tensor`` returns its input, as in eager (its meta kernel allocates a copy)."""

    def handle(self, func: torch._ops.OpOverload, args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: "OpNext") -> "OpValue":
        if func is _WAIT:
            return args[0]
        return next(func, args, kwargs)


try:
    _WAIT: "torch._ops.OpOverload | None" = torch.ops._c10d_functional.wait_tensor.default
except (AttributeError, RuntimeError) as failure:  # a torch built without distributed
    if is_interrupt(failure):
        raise  # a signal handler's exception (errors.is_interrupt) is the user's
    _WAIT = None


class ParallelRun:
    """One rank of ``fn`` on torch's fake process group: a context around the whole simulation."""

    def __init__(self, fn: "Callable[..., object] | None", world_size: int, rank: object, mesh: "MeshSizes | None",
                 pipeline: "Pipeline | None" = None, inputs: "UserValue" = None) -> None:
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"parallelize must be a function fn(model, mesh) -> model, got "
                                       f"{type(fn).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= int(rank) < world_size:
            raise InvalidArgumentError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.fn, self.n, self.rank = fn, world_size, int(rank)
        self.arity = _arity(fn) if fn is not None else 0  # how many arguments fn is called with
        if mesh is None and pipeline is not None:
            mesh = {"pp": world_size}
        self.shape, self.names = check_mesh(mesh, world_size)
        self.pipeline, self.inputs = pipeline, inputs
        self.stages: "StageSet | None" = None
        if pipeline is not None:
            from .pipeline import StageSet

            if not self.names or "pp" not in self.names:
                raise InvalidArgumentError("a pipeline needs a mesh dimension named 'pp' (mesh={'pp': 4, 'dp': 8}); "
                                           f"got {mesh!r}")
            d = self.names.index("pp")
            self.stages = StageSet(pipeline, self.shape[d], coordinates(self.rank, self.shape)[d])
        self.mesh: "DeviceMesh | None" = None
        self._stack: "contextlib.ExitStack | None" = None
        self.layouts: list[str] = []
        self.context_parallel = False
        # FSDP2's CPUOffloadPolicy: the offloaded parameters' padded shard bytes, and those of the trainable ones.
        self.offloaded: "tuple[int, int, int] | None" = None  # and the largest unit's
        self.fsdp1_notes: list[str] = []  # what the simulation did to FSDP1's arguments

    def __enter__(self) -> "ParallelRun":
        import torch.distributed as dist

        if not dist.is_available():
            raise MemprofError("estimate(parallelize=...) needs torch.distributed, which this torch is built without")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from .world_aside import world_aside

        stack = self._stack = contextlib.ExitStack()
        try:
            # A job's own process group (a pre-flight check after init_process_group) is set aside, untouched,
            # and put back after the rank, last.
            stack.enter_context(world_aside())
            _clear_caches()  # a process group of the user's, destroyed before, may have left its groups' names there
            # init_process_group wraps sys.excepthook to prefix "[rank<r>]" to tracebacks
            # (torch/distributed/distributed_c10d.py) and nothing unwraps it: the user's own later errors would
            # print as the simulated rank's. Put the hook back last, after the group is gone.
            stack.callback(setattr, sys, "excepthook", sys.excepthook)
            dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.n)
            stack.callback(_clear_caches)
            stack.callback(dist.destroy_process_group)
            self.mesh = init_device_mesh("cpu", self.shape, mesh_dim_names=self.names)
            stack.enter_context(_side_fake_mode_for_sharding_propagation())
            stack.callback(self._restore_handlers, _custom_handlers())
            if self.stages is not None:
                from .pipeline import static_shapes

                stack.enter_context(static_shapes())
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.mesh = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _restore_handlers(self, before: "_Handlers | None") -> None:
        """Context parallelism's dispatcher, which the user's function may switch on for the process
        (``_enable_context_parallel_dispatcher``), is switched off again after the rank."""
        if before is None or _custom_handlers() is before:
            return
        try:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.experimental._attention import _disable_context_parallel_dispatcher

            _disable_context_parallel_dispatcher()
            DTensor._op_dispatcher._custom_op_handlers = before
        except (ImportError, AttributeError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            pass

    def parallelize(self, model: nn.Module,
                    meta_twin: Callable[[nn.Module], "tuple[nn.Module, dict[int, torch.Tensor]]"],
                    fake_mode: "FakeTensorMode") -> "tuple[nn.Module, dict[int, torch.Tensor]]":
        """``fn`` on a meta twin of ``model``, outside the fake mode; the twin then materialised as fake CPU
        tensors. Returns it and, for each of ``model``'s parameters, the twin's parameter of the same name."""
        twin, _ = meta_twin(model)
        full = {id(p): name for name, p in twin.named_parameters(remove_duplicate=False)}
        if self.stages is not None:  # this rank's pipeline stage(s), cut from the twin
            prepared = None
            if self.fn is not None:
                def prepared(k: int) -> "tuple[nn.Module, FakeTensorMode]":
                    assert self.stages is not None  # (for mypy: this runs inside the branch above)
                    mod = self.stages._split(meta_twin(model)[0], k)
                    mod = self._apply(mod)
                    with fake_mode:
                        mod.to_empty(device="cpu")
                    return mod, fake_mode
            twin = self.stages.cut(twin, self.inputs, prepared)
        # Each of the (stage) twin's parameter names, and the model's name of the same parameter.
        own = {name: full.get(id(p), name) for name, p in twin.named_parameters(remove_duplicate=False)}
        if self.fn is not None:
            with fsdp1_in_fake_mode(fake_mode, self.fsdp1_notes):
                if self.stages is not None:  # each stage of the rank on its own, as the user's script parallelises it
                    self.stages.modules = [self._apply(m) for m in self.stages.modules]
                    mods = self.stages.modules
                    twin = mods[0] if len(mods) == 1 else nn.ModuleList(mods)
                else:
                    twin = self._apply(twin)
        if has_meta(twin):  # FSDP1's units were made on fake CPU tensors already: their storages are its own
            with fake_mode:
                twin.to_empty(device="cpu")
        # FSDP1 with use_orig_params=True names a parameter under its wrappers (clean_tensor_name drops them).
        names = {unwrapped(own.get(n, n)): p for n, p in twin.named_parameters(remove_duplicate=False)}
        mapping: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in names:
                mapping.setdefault(id(p), names[name])
        self.layouts = sorted(_layouts(twin))
        self.context_parallel = _context_parallel_on()
        self.offloaded = _offloaded(twin)
        return twin, mapping

    def inside_step(self) -> None:
        """Read inside a ``step_context``, after backward: ``context_parallel()`` switches ring attention on for its
        block only."""
        self.context_parallel = self.context_parallel or _context_parallel_on()

    def host_split(self, trace: "Trace") -> "tuple[int, int, str] | None":
        """Under ``CPUOffloadPolicy``: the rank's host bytes, its device peak, and a note saying how they were
        split. The simulation runs on the CPU, where FSDP2's host/device copies are no-ops
        (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), so the trace holds both together."""
        if self.offloaded is None:
            return None
        shards, trainable, unit = self.offloaded
        states = max((p.end[_O] or 0) for p in trace.phases) if trace.phases else 0
        host = shards + trainable + states
        peak = trace.peak
        # On a device FSDP2 copies a unit's shards host-to-device before its all-gather (all_gather_inputs,
        # sharded_param_data.to(device)), alive until the copy-in: the largest unit's, added.
        device = (peak.total or 0) - min(peak[_W] or 0, shards) - (peak[_O] or 0) + unit
        return host, device, offload_note(host, device, (shards, trainable, states, unit))

    def _apply(self, module: nn.Module) -> nn.Module:
        assert self.fn is not None
        try:
            out = self.fn(module, self.mesh) if self.arity == 2 else self.fn(module)
        except ValueError as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            if "default process group twice" not in str(exc):
                raise
            # torch's own words (distributed_c10d.py, init_process_group) from inside the user's function.
            raise InvalidArgumentError(
                f"parallelize={_named(self.fn)} initialises a process group itself (torch: {exc}); memprof calls it "
                f"on a fake process group of its own, initialised already, with the model and a DeviceMesh of "
                f"{self.n} rank(s) on that group. Initialise the process group in your training script, outside the "
                "function (or only when not torch.distributed.is_initialized()), and build the layout from the mesh "
                "the function is given") from exc
        if out is None:
            return module
        if not isinstance(out, nn.Module):
            raise InvalidArgumentError(f"parallelize must return the model (or None), got {type(out).__name__}")
        return out

    def _fsdp1_note(self) -> list[str]:
        return fsdp1_notes(self.fsdp1_notes) if "FullyShardedDataParallel" in self.layouts else []

    def _formula_note(self) -> list[str]:
        d = _degrees(self.names, self.shape)
        if not self.names or (d["dp"], d["tp"], d["pp"], d["ep"]) == (1, 1, 1, 1):
            return []
        experts = [] if d["ep"] == 1 else [
            f"the textbook's experts per rank (Fedus et al. 2021, Switch Transformers, §5.4): weights, gradients and "
            f"optimizer states of E/ep experts, divided by ep = {d['ep']} (and under ZeRO by the dp/ep ranks holding "
            "the same experts), and one MoE layer's all-to-all buffers (1 + c)·T·k·h·b: the T·k rows a rank sends "
            "and the c·T·k it receives, c the capacity factor of §2.2 (memprof.anatomy.parallelism.expert_terms "
            "gives the bytes)"]
        if (d["dp"], d["tp"], d["pp"]) == (1, 1, 1):
            return experts
        return experts + [
                f"the textbook per rank, by degree (ZeRO Table I over dp = {d['dp']}, every state of the split layers "
                f"divided by tp = {d['tp']} and pp = {d['pp']}): weights 2Ψ/(dp·tp·pp) under FSDP (2Ψ/(tp·pp) "
                "without it), gradients 2Ψ/(dp·tp·pp) from ZeRO stage 2, optimizer states KΨ/(dp·tp·pp) from stage 1; "
                "activations per layer sbh(34/t + 5as/(ht)) with sequence parallelism and sbh(10 + 24/t + 5as/(ht)) "
                "without (Korthikanti et al. 2022, §4: the 10sbh of norm inputs and dropout masks is not divided by "
                "t), times L/pp layers and the micro-batches in flight "
                "(memprof.anatomy.parallelism.rank_terms gives the bytes)"]

    @property
    def pipelined(self) -> bool:
        return self.stages is not None

    def step(self, loss_fn: "Callable[..., torch.Tensor] | None", optimizer: "torch.optim.Optimizer | None",
             inputs: "UserValue", targets: "UserValue", fake_mode: "FakeTensorMode | None") -> "PipelineStep":
        """The pipeline rank's training step (the schedule's), built in the fake mode before the profile."""
        # Inside the run, a pipeline rank's: its stages, mesh and fake mode exist.
        assert self.stages is not None and self.mesh is not None and fake_mode is not None
        with fake_mode:
            group = self.mesh["pp"].get_group() if len(self.shape) > 1 else None  # the pipeline's own ranks
            return self.stages.step(loss_fn, optimizer, inputs, targets, group)

    def stage_modules(self) -> "list[nn.Module]":
        """The stage modules this pipeline rank holds, in stage order (empty without ``pipeline=``)."""
        return list(self.stages.modules) if self.stages is not None else []

    def rules(self) -> "list[OpRule]":
        """The rules the step's ops run under, beneath the profiler: links of the simulation's
        :class:`~memprof.simulate.op_chain.OpChain`, the first outermost."""
        # TorchDispatchMode.__init__, which WaitIdentity keeps, is untyped.
        return [WaitIdentity()] if _WAIT is not None else []  # type: ignore[no-untyped-call]

    def notes(self) -> list[str]:
        mesh = " x ".join(f"{n}={s}" if self.names else str(s) for n, s in zip(self.names or self.shape, self.shape))
        how = ", ".join(self.layouts) or "no parallel layout found on the model"
        out = []
        if self.stages is not None:
            st = self.stages
            sched = st.pipeline.schedule if isinstance(st.pipeline.schedule, str) else st.pipeline.schedule.__name__
            out.append(f"pipeline: this rank holds stage(s) {', '.join(map(str, st.stage_ids))} of {st.num_stages}, "
                       f"run by torch's {sched} schedule over {st.pipeline.microbatches} micro-batches; the stages' "
                       "shapes came from a meta forward of one micro-batch, and the schedule's warm-up was told they "
                       "are static")
        out += self._formula_note() + self._fsdp1_note()
        if self.context_parallel:
            out.append("context parallelism: attention ran as torch's ring attention (its handler of the CUDA flash "
                       "attention op, on fake CPU tensors: a CPU has no kernel for it), so this is checked against no "
                       "CPU run; a GPU run validates it. Give device='cuda' so that attention is the flash op")
        who = "your parallelize function" if self.fn is not None else "the pipeline's stages"
        return out + [f"rank {self.rank} of {self.n}: {who} ran on a device mesh ({mesh}) on torch's fake "
                f"process group ({how}); collectives moved no data, their buffers are counted as FSDP/DTensor "
                "allocate them",
                "simulated on fake CPU tensors: wait_tensor returned its input as in eager, and DTensor's sharding "
                "propagation ran in a fake mode of its own (its global-shape tensors are metadata, not memory)"]


def coordinates(rank: int, shape: "tuple[int, ...]") -> "tuple[int, ...]":
    """A rank's coordinates on a mesh of ``shape`` (row-major, as ``init_device_mesh`` lays ranks out)."""
    out = []
    for size in reversed(shape):
        rank, c = divmod(rank, size)
        out.append(c)
    return tuple(reversed(out))


#: How the note of CPUOffloadPolicy's split begins (:func:`offload_note`).
OFFLOAD_NOTE = "CPUOffloadPolicy: host memory "


def offload_note(host: int, device: int, parts: "tuple[int, int, int, int] | None") -> str:
    """What :meth:`ParallelRun.host_split` says of CPUOffloadPolicy's split: ``host`` and ``device`` bytes, and their
    ``parts`` (the offloaded parameters' padded shards, their sharded gradients, the optimizer states, the largest
    unit's shards) where one run gave them; None: the figures extended in depth from the cuts' (each part a line in
    the blocks, :mod:`memprof.simulate.depth`)."""
    if parts is None:
        head = (f"{OFFLOAD_NOTE}{host:,} B and device peak {device:,} B, extended in depth from the cuts' split, "
                "each a line in the blocks: on the host")
        device_is = "; on the device"
        shards = grads = states = unit = ""
    else:
        head, device_is = f"{OFFLOAD_NOTE}{host:,} B =", f". Device peak {device:,} B ="
        shards, grads, states, unit = f" ({parts[0]:,} B)", f"{parts[1]:,} B, ", f"{parts[2]:,} B; ", \
            f" ({parts[3]:,} B)"
    return (f"{head} the offloaded parameters' padded shards{shards}, their sharded gradients ({grads}copied to the "
            f"host after each reduce-scatter) and the optimizer states ({states}the step runs on the CPU){device_is} "
            f"the trace's peak less the shards and optimizer states in it, plus the largest unit's shards{unit}, "
            "which FSDP2 copies to the device before its all-gather; the sharded gradients present at the peak are "
            "left on the device side, so that figure errs high, never low. The trace's categories hold host and "
            "device together (the simulation runs on the CPU, where FSDP2's copies between them do nothing)")


def depth_unit(world_size: int, mesh: "MeshSizes | None", pipeline: "Pipeline | None") -> int:
    """Blocks of the repeated stack per unit of depth: one per stage, ``pp * stages_per_rank`` of them."""
    if pipeline is None:
        return 1
    shape, names = check_mesh(mesh if mesh is not None else {"pp": world_size}, world_size)
    if not names or "pp" not in names:
        raise InvalidArgumentError(f"a pipeline needs a mesh dimension named 'pp'; got {mesh!r}")
    return shape[names.index("pp")] * pipeline.stages_per_rank


def _offloaded(model: nn.Module) -> "tuple[int, int, int] | None":
    from ..collect.shards import fsdp2_params

    groups = fsdp2_params(model) or {}
    shards = trainable = largest = 0
    found = False
    for group in groups.values():
        unit = 0
        for fp in group:
            if not getattr(fp, "offload_to_cpu", False):
                continue
            found = True
            nbytes = math.prod(fp.padded_sharded_param_size) * fp.sharded_param.element_size()
            shards, unit = shards + nbytes, unit + nbytes
            if fp.sharded_param.requires_grad:
                trainable += nbytes
        largest = max(largest, unit)
    return (shards, trainable, largest) if found else None


def _degrees(names: "tuple[str, ...] | None", shape: "tuple[int, ...]") -> "dict[str, int]":
    """The data, tensor and pipeline degrees of a mesh whose dimensions are named so (``dp``/``dp_shard``/
    ``dp_replicate``/``fsdp``, ``tp``, ``pp``, ``ep``)."""
    out = {"dp": 1, "tp": 1, "pp": 1, "ep": 1}
    for name, size in zip(names or (), shape):
        key = "dp" if name in ("dp", "fsdp", "dp_shard", "dp_replicate", "shard", "replicate") else name
        if key in out:
            out[key] *= size
    return out


def _arity(fn: Callable[..., object]) -> int:
    """How memprof calls the user's parallelize function: 2 for ``fn(model, mesh)``, 1 for ``fn(model)``; an
    InvalidArgumentError naming the function and its parameters when neither call would bind, before anything
    runs (rather than torch's TypeError from the middle of the simulation)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return 2  # a callable whose parameters Python cannot read: called as documented
    for n in (2, 1):
        try:
            sig.bind(*range(n))
        except TypeError as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            continue
        return n
    raise InvalidArgumentError(
        f"parallelize={_named(fn)} takes {sig}, but memprof calls it as fn(model, mesh) (the model, and a torch "
        "DeviceMesh of the estimate's world size and mesh) or fn(model); give it those parameters (any others need "
        "defaults), and return the model, or None when it parallelises the model in place")


def _named(fn: Callable[..., object]) -> str:
    """The user's function as an error names it: its qualified name where it has one."""
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", None)
    return str(name) if name else repr(fn)[:80]


def _layouts(model: nn.Module) -> set[str]:
    """What the parallelized model is made of: ``fully_shard`` units, DTensor placements."""
    from torch.distributed.tensor import DTensor

    kinds = {type(m).__name__ for m in model.modules()}
    out = {"fully_shard"} if any(k.startswith("FSDP") for k in kinds) else set()
    if "FullyShardedDataParallel" in kinds:
        out.add("FullyShardedDataParallel")
    for p in model.parameters():
        if isinstance(p, DTensor):
            out.add("DTensor " + ", ".join(sorted({repr(pl) for pl in p.placements})))
    return out


@contextlib.contextmanager
def _side_fake_mode_for_sharding_propagation() -> Iterator[None]:
    """DTensor's sharding propagation takes ``detect_fake_mode() or FakeTensorMode()``; during the simulation it
    gets a mode of its own, so its global-shape tensors are told apart from the rank's (no hook exists for it:
    the module's name is rebound for the block and restored after it, also when the block raises)."""
    try:
        from torch.distributed.tensor import _sharding_prop
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    side = FakeTensorMode(allow_non_fake_inputs=True)
    original = getattr(_sharding_prop, "detect_fake_mode", None)
    if original is None:
        yield
        return
    _sharding_prop.detect_fake_mode = lambda *a, **k: side
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


def _custom_handlers() -> "_Handlers | None":
    try:
        from torch.distributed.tensor import DTensor

        return DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def _context_parallel_on() -> bool:
    handlers = _custom_handlers() or {}
    return any("flash_attention" in str(op) for op in handlers)


def _clear_caches() -> None:
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return
    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]  # torch's is untyped

