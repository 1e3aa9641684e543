"""The distributed option of an analysis: world size, rank, and the user's ``parallelize(model, mesh)``.

The user's function is the code of their training script that shards or wraps the model
(``fully_shard`` per block and on the root, or ``DistributedDataParallel``). fxmem applies it to its
own fake copy of the model, inside torch's in-process fake process group, so the user's model and
process-group state are never touched.

>>> def fsdp(model, mesh):                                                # doctest: +SKIP
...     for block in model.layers:
...         fully_shard(block, mesh=mesh)
...     return fully_shard(model, mesh=mesh)
>>> Parallel(8, 0, fsdp).check()                                         # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator

import sympy
import torch

from .. import _torch_compat as tc
from ..errors import FxMemError, ModelError, SpecError


def late_bytes(gathers: list[int], reduces: list[int]) -> int:
    """The most an asynchronous backend can add to a synchronous schedule's live bytes (bytes).

    Only the collectives' own buffers can outlive their synchronous free: each all-gather's flat
    buffer, which its work holds until the collective completes, with gloo's two temporaries of
    its size (one on the calling thread, one on its worker), and each reduce-scatter's input. At
    worst all of them of one step are alive at once: their sum. (On gloo, rank 0 of a 4-block
    decoder on 2 ranks held three all-gather buffers past the end of the step.)"""
    return 3 * sum(gathers) + sum(reduces)


# DTensor's collectives (tensor and sequence parallelism, a Partial gradient's all-reduce): the
# op that allocated the buffer each returns, as the simulation records it on the storage
DTENSOR_COLLECTIVES = ("_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
                       "_c10d_functional.reduce_scatter_tensor")


def dtensor_buffers(storages: list) -> tuple[list, list, list]:
    """The buffers DTensor's collectives returned in the simulated step (bytes, sympy): its
    all-reduces', all-gathers' and reduce-scatters' outputs."""
    return tuple([s.bytes for s in storages if s.op == op] for op in DTENSOR_COLLECTIVES)


def dtensor_late_bytes(all_reduces: list, all_gathers: list, reduce_scatters: list, group: int) -> Any:
    """The most an asynchronous gloo backend can add to a synchronous schedule's live bytes
    through DTensor's collectives (bytes, sympy), on groups of at most ``group`` ranks.

    A collective's work holds the buffer it returns until gloo's worker thread drops the work,
    so each output can outlive its synchronous free (and a free on the worker thread is never
    seen by a profiler on the calling one: until then it counts as live). Besides, gloo runs an
    all-gather into a flat buffer of the output's size it allocates on its worker, and holds the
    input (at most the output's size); and it runs a reduce-scatter as an all-reduce of a clone
    of its input (``group`` x the output), held until the reduce-scatter is waited on. At worst
    all of them of one step are alive at once: their sum."""
    return sum(all_reduces) + 3 * sum(all_gathers) + (1 + group) * sum(reduce_scatters)


def _bytes(expr: Any) -> str:
    """A byte count as the notes show it: ``1,234`` or a formula in the user's dims."""
    expr = sympy.expand(expr)
    return f"{int(expr):,}" if expr.is_number else str(expr)


def _refuse_ddp_maps(stage: torch.nn.Module) -> None:
    """Refuse a pipeline stage wrapped by DDP that keeps a map of the parameters that got gradients
    (``find_unused_parameters=True``, ``static_graph=True``): the map's reads are modelled for a
    model wrapped whole, not for a stage yet."""
    if type(stage).__name__ == "DistributedDataParallel" and (getattr(stage, "find_unused_parameters", False)
                                                             or getattr(stage, "static_graph", False)):
        raise ModelError("parallelize=: a pipeline stage wrapped by DistributedDataParallel with "
                         "find_unused_parameters=True or static_graph=True is not modelled yet (the map of used "
                         "parameters DDP reads then); wrap the stage without them, or shard it with FSDP2")


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Rank ``rank`` of ``world_size`` ranks, the model parallelised by ``fn(model, mesh)``."""

    world_size: int
    rank: int
    fn: Callable[[torch.nn.Module, Any], torch.nn.Module]
    how: str = "parallelize="  # what the report says parallelised the model
    mesh: tuple[tuple[str, int], ...] | None = None  # ((dim name, size), ...): the mesh fn is given; None: 1-D

    @classmethod
    def of(cls, options: Any) -> "Parallel":
        """The analysis options' ``world_size=``, ``rank=``, ``parallelize=`` and ``mesh=``."""
        mesh = options.mesh
        if mesh is not None and not isinstance(mesh, dict):
            raise SpecError(f"mesh= must be a dict {{dim name: size}}, e.g. {{'dp': 2, 'tp': 4}}; got {mesh!r:.60}")
        return cls(options.world_size, options.rank or 0, options.parallelize,
                   mesh=tuple(mesh.items()) if mesh is not None else None)

    def shape(self) -> str:
        """The mesh ``fn`` is given, as messages name it."""
        if self.mesh is None:
            return f"(1-D, {self.world_size} ranks)"
        return "(" + " x ".join(f"{name} {size}" for name, size in self.mesh) + ")"

    def check(self) -> None:
        """Refuse what cannot mean anything, naming the argument."""
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise SpecError(f"world_size must be a positive int (the number of ranks), got {self.world_size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise SpecError(f"rank={self.rank!r}: use a rank from 0 to world_size - 1 = {self.world_size - 1}")
        if not callable(self.fn):
            raise SpecError("parallelize= must be a function fn(model, mesh) that applies fully_shard or "
                            "DistributedDataParallel and returns the model to run")
        if self.mesh is not None:
            shown = dict(self.mesh)
            if not self.mesh or any(not isinstance(k, str) or not k or isinstance(v, bool) or not isinstance(v, int)
                                    or v < 1 for k, v in self.mesh):
                raise SpecError(f"mesh={shown!r}: give each dim of the DeviceMesh a name and a positive size, e.g. "
                                f"{{'dp': 2, 'tp': 4}}")
            if math.prod(v for _, v in self.mesh) != self.world_size:
                raise SpecError(f"mesh={shown!r} has {math.prod(v for _, v in self.mesh)} ranks, but world_size="
                                f"{self.world_size}: the mesh's sizes multiply to the world size")
        if not tc.distributed_available() or tc.dtensor_type() is None:  # (imports DTensor for the recorder)
            raise FxMemError("this torch was built without torch.distributed: world_size=/parallelize= need it")

    @contextlib.contextmanager
    def world(self, device: str = "cpu") -> Iterator[Any]:
        """torch's fake process group for this rank, with its device mesh (1-D, or ``self.mesh``'s
        named dims); removed on exit.

        A process group the user started is set aside meanwhile (never used: its collectives would
        reach the other ranks) and is back, untouched, on exit."""
        with tc.fake_process_group(self.world_size, self.rank, device, self.mesh) as mesh, \
                tc.fsdp_without_gpu(device):
            yield mesh

    @staticmethod
    def tensor_parallel(model: torch.nn.Module) -> bool:
        """Whether ``model`` (what :meth:`apply` returned) has DTensor parameters FSDP2 does not
        manage: tensor parallelism alone (FSDP2 over tensor-parallel parameters manages them)."""
        dtensor = tc.dtensor_type_if_loaded()
        if dtensor is None:
            return False
        managed = tc.fsdp2_managed(model)
        return any(isinstance(p, dtensor) and id(p) not in managed for p in model.parameters())

    def notes(self, storages: list, device: str = "cpu", tensor_parallel: bool = False,
              sent: list | None = None) -> list[str]:
        """What the report says about the collectives: the schedule its numbers are for, and how
        much an asynchronous backend can hold beyond it (bytes). ``sent``: for a pipeline stage, the
        bytes of each storage the recorded step sent to another stage."""
        gathers = [int(s.bytes) for s in storages if s.name.startswith("all-gather ") and s.bytes.is_number]
        reduces = [int(s.bytes) for s in storages if s.name.startswith("reduce-scatter ") and s.bytes.is_number]
        layout = f" over the mesh {dict(self.mesh)}" if self.mesh is not None else ""
        out = [f"rank {self.rank} of {self.world_size}{layout}, parallelised by {self.how}: torch's fake process "
               f"group ran the collectives (they allocate nothing of their own there)"]
        if device == "cuda":
            out.append("on CUDA, NCCL's own buffers live outside PyTorch's caching allocator and are not counted "
                       "(neither does torch.cuda.max_memory_allocated); FSDP2's streams are taken in program order "
                       "(the order its events enforce)")
        buckets = [int(s.bytes) for s in storages if s.name.startswith("DDP gradient bucket ") and s.bytes.is_number]
        if buckets:
            out.append(f"DDP: the steady state's numbers; the one step in which DDP rebuilds its gradient buckets in "
                       f"the order backward made the gradients (the second, or with static_graph=True the third) "
                       f"holds the new buckets beside the old at its peak: {sum(buckets):,} bytes more")
        if device != "cpu":
            return out
        if sent is not None:
            out.append(
                f"the pipeline's sends and receives as a synchronous schedule (a sent tensor freed when the schedule "
                f"lets go of it); with asynchronous ones (gloo on CPU) a send's work holds its tensor until gloo's "
                f"worker thread drops it: a rank's peak (and what the step leaves allocated) can then exceed these "
                f"numbers by up to {_bytes(sum(sent))} bytes (the step's {len(sent)} sent activations and gradients)")
        # a DTensor collective runs on one dim of the mesh: its group has at most the largest dim's ranks
        group = max(size for _, size in self.mesh) if self.mesh is not None else self.world_size
        dtensor = dtensor_buffers(storages)
        late = dtensor_late_bytes(*dtensor, group)
        parts = [f"{k} x the step's {len(b)} {what} buffers, {_bytes(sum(b))} B" if k != 1 else
                 f"the step's {len(b)} {what} buffers, {_bytes(sum(b))} B"
                 for k, b, what in ((1, dtensor[0], "all-reduce"), (3, dtensor[1], "all-gather"),
                                    (1 + group, dtensor[2], "reduce-scatter output")) if b]
        if gathers:
            late += late_bytes(gathers, reduces)
            parts = [f"3 x the step's {len(gathers)} all-gather buffers, {sum(gathers):,} B, + its {len(reduces)} "
                     f"reduce-scatter buffers, {sum(reduces):,} B"] + [f"tensor parallelism's {p}" for p in parts]
            out.append(
                f"FSDP2's collectives as a synchronous schedule (each buffer freed when its collective's result "
                f"is used); with asynchronous ones (gloo on CPU) a buffer is freed when its collective completes, "
                f"and gloo allocates temporaries of an all-gather's size: a rank's peak (and what the step leaves "
                f"allocated) can then exceed these numbers by up to {_bytes(late)} bytes ({'; + '.join(parts)})")
        elif tensor_parallel or parts:
            out.append(
                f"tensor parallelism's collectives as a synchronous schedule (each buffer freed when the code lets "
                f"go of it); with asynchronous ones (gloo on CPU) a collective's work holds its buffer until gloo's "
                f"worker thread drops it (an all-gather fills a flat buffer of its own there, a reduce-scatter "
                f"all-reduces a copy of its input): a rank's peak (and what the step leaves allocated) can then "
                f"exceed these numbers by up to {_bytes(late)} bytes ({'; + '.join(parts) or 'none recorded'})")
        return out

    def reads(self, model: torch.nn.Module, held: list[tuple[str, torch.Tensor]]) -> Any:
        """While ``model`` (what :meth:`apply` returned, with its ``held`` tensors) runs: the values
        its wrapper reads that fake tensors do not have (DDP's used-parameter map)."""
        from .ddp import used_map_reads
        return used_map_reads(model, held)

    def apply(self, model: torch.nn.Module, mesh: Any) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
        """``fn(model, mesh)``: the model to run (``fn`` may wrap it or return it sharded in place),
        and what its wrapper keeps besides parameters and buffers, as ``(name, tensor)``: DDP's
        gradient buckets and maps (resident from the start, see :func:`~fxmem.distributed.ddp.reducer_state`)."""
        tc.import_parallel_packages()  # (before the fake mode's fully_shard, DTensor and pipelining code runs)
        try:
            with tc.ddp_on_fake_tensors(), tc.fsdp_meshes_outside_fake(), tc.tensors_made() as made:
                out = self.fn(model, mesh)
        except FxMemError:
            raise
        except tc.DATA_DEPENDENT_ERRORS as exc:
            raise ModelError(
                "parallelize= read the values of a tensor fxmem only has as a fake one (a DeviceMesh built inside "
                "it from a tensor, or a check on parameter values); build meshes from the one fxmem passes in "
                "(slicing it, mesh['tp'], and fully_shard's reshard_after_forward=<int> are supported; for a "
                "mesh of more than one dimension pass mesh={'dp': ..., 'tp': ...}: fxmem builds it)") from exc
        except Exception as exc:
            raise ModelError(f"parallelize= raised {type(exc).__name__}: {exc}".splitlines()[0] +
                             "; it is called as fn(model, mesh) on fxmem's fake copy of the model, with the "
                             f"DeviceMesh {self.shape()} over torch's fake process group") from exc
        if out is None:
            out = model  # fully_shard works in place: returning nothing means the model itself
        from .pipeline import is_pipeline
        from .wrappers import refuse_unmodelled
        if is_pipeline(out):  # this rank's schedule (fxmem.distributed.pipeline): FSDP2, DTensors or DDP in its stages
            from .ddp import install_allreduce, reducer_state
            held = []
            for stage in tc.schedule_stages(out):
                refuse_unmodelled(stage.submod, "parallelize=", placed_here=True)
                _refuse_ddp_maps(stage.submod)
                install_allreduce(stage.submod)  # a stage wrapped by DDP: its buckets, all-reduced over "dp"
                held += [(f"{name} (stage {tc.stage_index(stage)})", t)
                         for name, t in reducer_state(stage.submod, made)]
            return out, held
        if not isinstance(out, torch.nn.Module):
            raise ModelError(f"parallelize= returned {type(out).__name__}; return the module to run (the "
                             f"model after fully_shard, or the DistributedDataParallel wrapper)")
        from .ddp import install_allreduce, reducer_state
        refuse_unmodelled(out, "parallelize=", placed_here=True)
        if getattr(mesh, "device_type", "cpu") == "cuda" and any(
                type(m).__name__ == "DistributedDataParallel" for m in out.modules()):
            raise ModelError("DistributedDataParallel with device='cuda' is not modelled yet: its C++ reducer "
                             "orders gradient buckets with CUDA events fxmem does not simulate; analyse DDP with "
                             "device='cpu' (the bucket and gradient bytes are the same; CUDA rounds each "
                             "allocation up to 512 bytes), or FSDP2 with device='cuda'")
        return install_allreduce(out), reducer_state(out, made)
