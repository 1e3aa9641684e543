"""``torch.distributed``: c10d's process-group state and the in-process fake process group
(``torch.testing._internal.distributed.fake_pg``), DTensor (its local shard, its sharding
propagation), FSDP1 and FSDP2 (``fully_shard``'s state, param groups, device handle and post-forward
mesh), DDP (its constructor's settings, its reducer, its used-parameter map, its start-up checks),
torch's ``FSDPMemTracker``, and the storage resizes FSDP2 frees and re-allocates its unsharded
parameters with (``UntypedStorage.resize_``).

Every function imports ``torch.distributed`` where it runs, never at module level: importing it costs a
fifth of a second, and most analyses have no ranks (``fsdp1_type`` and ``fsdp2_state`` do not even
import FSDP where nothing else has).

On a torch upgrade, what breaks here (the most volatile internals fxmem reads): c10d's module globals
(``_world``, ``_pg_map`` ..., ``_group_count``), ``_unregister_process_group``, ``FakeStore``'s module;
FSDP2's private modules under ``torch.distributed.fsdp._fully_shard`` (``_fsdp_state``,
``_fsdp_param_group``, ``_fsdp_init`` / ``_fully_shard``, ``_fsdp_collectives``), the attributes of
``FSDPParamGroup`` / ``FSDPParam`` and the composable registry key; DDP's attributes (``reducer``,
``bucket_bytes_cap`` ..., ``_get_ddp_logging_data``) and the start-up helpers of
``torch.nn.parallel.distributed``; ``ShardingPropagator._fake_mode_lock`` and ``propagate_op_sharding``'s cache, and
``torch._C._clear_DTensor_sharding_propagator_cache``;
``torch.distributed._tools.fsdp2_mem_tracker``.

Imports :mod:`.ops` (dispatch modes, pytree, ``real_mode``) and :mod:`.fake` (storage keys).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Callable, Iterator

import torch

from .fake import storage_key
from .ops import DispatchMode, real_mode, tree_leaves


def distributed_available() -> bool:
    import torch.distributed as dist
    return dist.is_available()


# c10d's process-group state lives in module globals that _World's properties read; a private
# world swaps them all (and the default group) for fresh ones, so that fxmem's fake group never
# shares a name, a map entry or the default slot with a group the user started
_C10D_MAPS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
_C10D_VALUES = ("_group_count", "_backend", "_default_pg_init_method")
_private_worlds = itertools.count()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int, device: str = "cpu",
                       dims: tuple[tuple[str, int], ...] | None = None) -> Iterator[Any]:
    """torch's in-process fake process group (backend ``"fake"``: collectives do nothing) of
    ``world_size`` ranks, seen from ``rank``, with a ``device`` mesh over it: 1-D, or of the named
    ``dims`` (``(("dp", 2), ("tp", 2))``, whose sizes multiply to ``world_size``).

    It lives in a private copy of c10d's state: a process group the user started (their default
    group, their sub-groups, the names torch's C++ registry resolves them by, ``sys.excepthook``,
    the global rank) is set aside while the fake one runs and is back, untouched, on exit; fxmem's
    groups are shut down and unregistered by name (never ``destroy_process_group``, which would
    unregister every group of the process)."""
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {n: getattr(c10d, n) for n in (*_C10D_MAPS, *_C10D_VALUES) if hasattr(c10d, n)}
    world, hook = c10d._world, sys.excepthook
    users_rank = dist.get_rank() if dist.is_initialized() else -1
    for name in _C10D_MAPS:
        if name in saved:
            setattr(c10d, name, type(saved[name])())
    c10d._world = c10d._World()
    # default names are str(group_count): start far from the user's so the C++ registry never
    # holds two groups under one name
    c10d._group_count = (1 << 30) + (next(_private_worlds) << 16)
    forget_dtensor_shardings()  # a sharding the user's run cached names the user's groups
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        if dims is None:
            yield init_device_mesh(device, (world_size,))
        else:
            yield init_device_mesh(device, tuple(size for _, size in dims),
                                   mesh_dim_names=tuple(name for name, _ in dims))
    finally:
        forget_dtensor_shardings()  # ... and one cached here names fxmem's, gone on exit
        try:
            for pg, name in list(c10d._world.pg_names.items()):
                with contextlib.suppress(Exception):
                    pg.shutdown()
                with contextlib.suppress(Exception):
                    c10d._unregister_process_group(name)
        finally:
            for name, value in saved.items():
                setattr(c10d, name, value)
            c10d._world = world
            sys.excepthook = hook
            torch._C._distributed_c10d._set_global_rank(users_rank)


def forget_dtensor_shardings() -> None:
    """Empty DTensor's caches of sharding propagation (Python's and the C++ dispatch fast path's).

    They are keyed by the ops' input specs, whose mesh compares by shape and ranks, not by process
    group; an entry's output spec keeps the mesh it was made with. So an entry made on another
    process group's mesh - the user's, or an earlier fake world's - would send this world's
    collectives to a group that is not this one's (torch raises "Could not resolve the process
    group registered under the name ..."), or the user's later ops to fxmem's gone fake group.
    Emptying them costs the next ops a propagation each; it changes no result."""
    import sys
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:  # never imported: nothing cached
        return
    dispatcher = getattr(getattr(tensor, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    cached = getattr(propagator, "propagate_op_sharding", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # torch >= 2.8
    if native is not None:
        native()


def functional_collective(name: str) -> Any:
    """``torch.ops._c10d_functional.<name>`` (the ops DTensor's and functional collectives run),
    or None in a torch built without torch.distributed."""
    if not distributed_available():
        return None
    try:
        return getattr(torch.ops._c10d_functional, name)
    except (AttributeError, RuntimeError):
        return None


def dtensor_type() -> type | None:
    """DTensor's class (None where torch.distributed is not built)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4 or no distributed
        return None
    return DTensor


def dtensor_type_if_loaded() -> type | None:
    """DTensor's class if ``torch.distributed.tensor`` was imported (else no DTensor can exist;
    importing it costs a fifth of a second)."""
    import sys
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def dtensor_shards(model: torch.nn.Module) -> list[tuple[str, tuple, tuple]]:
    """Each DTensor parameter of ``model`` as ``(name, global shape, ((mesh dim name, tensor dim),
    ...))``: which dims of its mesh shard which of its dims (``Shard``, FSDP2's ``_StridedShard``).
    A 1-D mesh without names is ``"world"``."""
    dtensor = dtensor_type_if_loaded()
    if dtensor is None:
        return []
    out = []
    for name, p in model.named_parameters():
        if not isinstance(p, dtensor):
            continue
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or (("world",) if mesh.ndim == 1 else tuple(f"dim{k}" for k in range(mesh.ndim)))
        # (FSDP2's _StridedShard over tensor parallelism's Shard is no Shard to is_shard())
        shards = tuple((names[k], int(pl.dim)) for k, pl in enumerate(p.placements)
                       if "Shard" in type(pl).__name__ and isinstance(getattr(pl, "dim", None), int))
        out.append((name, tuple(int(d) for d in p.shape), shards))
    return out


def attention_ops() -> frozenset:
    """ATen's fused attention kernels (the ops torch's context parallelism replaces by ring attention)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def context_parallel_active() -> bool:
    """Whether torch's context parallelism (``context_parallel``, ``_ContextParallel``) has DTensor
    dispatch attention to ring attention now: its custom handlers for the fused attention ops."""
    dtensor = dtensor_type_if_loaded()
    handlers = getattr(getattr(dtensor, "_op_dispatcher", None), "_custom_op_handlers", None) or {}
    return any(op in handlers for op in attention_ops())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data: a DTensor's local shard, else ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


@contextlib.contextmanager
def dtensor_propagation_quiet(quiet: Any) -> Iterator[None]:
    """DTensor's sharding propagation runs each op once on global-shape fake tensors to learn the
    output's metadata; no real run allocates those. ``quiet()`` (a context manager) is entered
    around it, through the hook DTensor itself offers for that section (``_fake_mode_lock``)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    old = ShardingPropagator.__dict__.get("_fake_mode_lock")
    if old is None:
        raise RuntimeError("this torch's DTensor has no ShardingPropagator._fake_mode_lock")

    class _Quiet:
        def __enter__(self) -> None:
            self._cm = quiet()
            self._cm.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self._cm.__exit__(*exc)

    ShardingPropagator._fake_mode_lock = _Quiet()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = old


def fsdp1_type() -> type | None:
    import sys
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP1 module can exist: skip the import
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def fsdp2_state(module: torch.nn.Module) -> Any:
    """FSDP2's state of a module ``fully_shard`` was applied to (None if it was not)."""
    import sys
    if "torch.distributed.fsdp" not in sys.modules:  # fully_shard was never imported
        return None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return None
    return _get_module_fsdp_state(module)


def pipeline_stage_types() -> list:
    """The classes whose construction starts a pipeline stage (``torch.distributed.pipelining``'s
    ``PipelineStage`` and the tracer front end's stages share one base), where that package is
    imported already; else none."""
    import sys
    module = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(module, "_PipelineStageBase", None) if module is not None else None
    return [base] if isinstance(base, type) else []


def fsdp2_lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialisation, now rather than at the first forward: each state ``fully_shard``
    put in ``module``'s tree that no other one initialised (top-most first, as the first forward
    would reach them) picks its root and re-creates its sharded parameters (a shard FSDP2 pads
    gets new storage there), so what is read after this is what every later step uses."""
    for sub in module.modules():  # pre-order: a root before the states inside it
        state = fsdp2_state(sub)
        if state is not None and getattr(state, "_is_root", False) is None:
            state._lazy_init()


def fsdp2_managed(module: torch.nn.Module) -> set[int]:
    """``id()`` of every sharded parameter FSDP2 manages in ``module``'s tree (its own DTensors)."""
    ids: set[int] = set()
    for sub in module.modules():
        state = fsdp2_state(sub)
        if state is None:
            continue
        for group in _fsdp2_param_groups(state):
            for fsdp_param in group.fsdp_params:
                ids.add(id(fsdp_param.sharded_param))
    return ids


def _fsdp2_param_groups(state: Any) -> list:
    groups = list(getattr(state, "_fsdp_param_groups", None) or [])
    if not groups and getattr(state, "_fsdp_param_group", None) is not None:  # torch < 2.10
        groups = [state._fsdp_param_group]
    return groups


# FSDPParamGroup's settings that FSDPModule's setters change after fully_shard (those this torch has)
_FSDP2_KNOBS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "reduce_scatter_max_input_buffers",
                "gradient_divide_factor", "reduce_scatter_unused_params", "force_sum_reduction_for_comms",
                "unshard_async_op", "unshard_in_backward")


def fsdp2_groups(root: torch.nn.Module) -> list[dict]:
    """What ``fully_shard`` was applied to in ``root``'s tree, children first, as plain data:
    ``modules`` (the modules of one call), ``mesh``, ``kwargs`` (the call's keyword arguments
    that matter for memory: ``reshard_after_forward``, ``mp_policy``, ``offload_policy``,
    ``placements`` by parameter name), ``knobs`` (settings changed after the call), ``forward``
    / ``backward`` prefetch (module lists), ``unsupported`` (what cannot be recreated, named)."""
    order: list[torch.nn.Module] = []

    def post(m: torch.nn.Module, seen: set) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            post(child, seen)
        order.append(m)
    post(root, set())
    out, done = [], set()
    for m in order:
        state = fsdp2_state(m)
        if state is None or id(state) in done:
            continue
        done.add(id(state))
        groups = _fsdp2_param_groups(state)
        unsupported = []
        if len(groups) > 1:
            unsupported.append("a shard_placement_fn placing parameters on several meshes")
        group = groups[0] if groups else None
        mesh = group.mesh_info.mesh if group is not None else None
        if getattr(state, "_auto_reshard_after_forward", False):
            reshard: Any = None
        elif group is None or group.post_forward_mesh_info is None:
            reshard = False
        elif group.post_forward_mesh_info is group.mesh_info or \
                group.post_forward_mesh_info.mesh is group.mesh_info.mesh:
            reshard = True
        else:
            reshard = int(group.post_forward_mesh_info.shard_mesh_size)
        kwargs: dict = {"reshard_after_forward": reshard, "mp_policy": getattr(state, "_mp_policy", None)}
        placements: dict = {}
        knobs: dict = {}
        if group is not None:
            kwargs["mp_policy"] = group.mp_policy
            kwargs["offload_policy"] = group.offload_policy
            for fp in group.fsdp_params:
                info = fp._module_info
                placements[(id(info.module), info.param_name)] = fp.fsdp_placement
            knobs = {k: getattr(group, k) for k in _FSDP2_KNOBS if hasattr(group, k)}
            if getattr(group, "_all_reduce_hook", None) is not None:
                unsupported.append("an all-reduce hook (set_all_reduce_hook)")
            for attr, default in (("_all_gather_comm", "DefaultAllGather"),
                                  ("_reduce_scatter_comm", "DefaultReduceScatter")):
                comm = getattr(group, attr, None)
                if comm is not None and type(comm).__name__ != default:
                    unsupported.append(f"a custom collective ({type(comm).__name__})")
        out.append(dict(modules=tuple(state._modules), mesh=mesh, kwargs=kwargs, placements=placements,
                        knobs=knobs, unsupported=unsupported,
                        forward=[s._modules[0] for s in getattr(state, "_states_to_forward_prefetch", [])],
                        backward=[s._modules[0] for s in getattr(state, "_states_to_backward_prefetch", [])]))
    return out


def fsdp2_set_knobs(module: torch.nn.Module, knobs: dict) -> None:
    """Give the param group of ``module`` (fully_shard applied) the settings ``knobs``."""
    for group in _fsdp2_param_groups(fsdp2_state(module)):
        for k, v in knobs.items():
            setattr(group, k, v)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                 "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _from_fsdp(fn: Any) -> bool:
    fn = getattr(fn, "hook", fn)  # _WrappedHook (state-dict hooks)
    fn = getattr(fn, "func", fn)  # functools.partial
    owner = getattr(fn, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(fn, "__module__", "") or ""
    return where.startswith("torch.distributed.fsdp")


def fsdp2_unsharded_copy(root: torch.nn.Module) -> torch.nn.Module:
    """``root`` as it was before ``fully_shard``: the same module classes and attributes, each
    sharded parameter a meta tensor of its full size and dtype (no data, no memory), FSDP2's
    classes, hooks and registry entries left out. Other parameters and buffers are ``root``'s
    own tensors (shared, never written: the analysis copies them)."""
    from torch.distributed._composable.contract import REGISTRY_KEY
    from torch.distributed.fsdp import FSDPModule

    _COMPOSABLE_KEY = REGISTRY_KEY[:REGISTRY_KEY.rindex("_")]

    placements: dict = {}
    for sub in root.modules():
        state = fsdp2_state(sub)
        for group in _fsdp2_param_groups(state) if state is not None else []:
            for fp in group.fsdp_params:
                info = fp._module_info
                for m, n in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                    placements[(id(m), n)] = fp
    made: dict[int, torch.nn.Module] = {}
    full: dict[int, torch.nn.Parameter] = {}

    def copy(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in made:
            return made[id(m)]
        cls = type(m)
        if isinstance(m, FSDPModule):
            cls = cls.__mro__[getattr(FSDPModule, "_orig_cls_mro_index", 2)]
        new = cls.__new__(cls)
        made[id(m)] = new
        d = {k: v for k, v in m.__dict__.items()  # composable APIs' state and registry keys share a prefix
             if not k.startswith(_COMPOSABLE_KEY) and k not in ("_is_fsdp_managed_module", "_fsdp_use_orig_params")}
        for k in _MODULE_HOOKS:  # FSDP2's hooks (all-gather before forward, ...) stay behind
            if isinstance(d.get(k), dict):
                d[k] = type(d[k])((key, hook) for key, hook in d[k].items() if not _from_fsdp(hook))
        kept = {key for k in _MODULE_HOOKS if isinstance(d.get(k), dict) for key in d[k]}
        for k in _HOOK_FLAGS:  # the flags of hooks left behind go with them
            if isinstance(d.get(k), dict):
                d[k] = type(d[k])((key, f) for key, f in d[k].items() if key in kept)
        params = type(m._parameters)()
        for name, p in m._parameters.items():
            fp = placements.get((id(m), name))
            if fp is None:
                params[name] = p
                continue
            if id(fp) not in full:
                full[id(fp)] = torch.nn.Parameter(torch.empty(tuple(fp._orig_size), dtype=fp.sharded_param.dtype,
                                                              device="meta"),
                                                  requires_grad=fp.sharded_param.requires_grad)
            params[name] = full[id(fp)]
        d["_parameters"] = params
        d["_modules"] = type(m._modules)((k, None if c is None else copy(c)) for k, c in m._modules.items())
        object.__setattr__(new, "__dict__", d)
        return new
    return copy(root)


# the torch.distributed packages a parallelize= builds with: imported before it runs, outside fxmem's
# fake mode. An import runs the module's code, and some make tensors (pipelining's sum_reducer holds
# torch.tensor(0.0)): a first import under the fake mode would leave a fake tensor in torch's module for
# the process's life - alive in every later step, counted as memory the step keeps (4 bytes), and fake
# in the user's own pipeline runs after the analysis.
_PARALLEL_PACKAGES = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                      "torch.distributed.pipelining")


def import_parallel_packages() -> None:
    """Import :data:`_PARALLEL_PACKAGES` (those not imported yet) with no fake or dispatch mode active."""
    import importlib
    import sys

    missing = [name for name in _PARALLEL_PACKAGES if name not in sys.modules]
    if not missing or not torch.distributed.is_available():
        return
    with real_mode():
        for name in missing:
            try:
                importlib.import_module(name)
            except ImportError:  # an older torch without it: nothing of it can run
                pass


@contextlib.contextmanager
def fsdp_meshes_outside_fake() -> Iterator[None]:
    """Let ``fully_shard(..., reshard_after_forward=<int>)`` run on fxmem's fake copy: it builds the
    post-forward DeviceMesh (groups of that many ranks) from the mesh's rank tensor, whose values a
    DeviceMesh reads. The mesh is a real tensor fxmem made before the fake mode; this builds the
    sub-mesh with no mode active (a mesh holds ranks, never the model's memory)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    except ImportError:  # torch without FSDP2: nothing to patch
        yield
        return
    modules = [m for m in (_fsdp_init, _fully_shard) if hasattr(m, "_get_post_forward_mesh_info")]
    saved = [(m, m._get_post_forward_mesh_info) for m in modules]

    def outside_fake(original: Callable) -> Callable:
        def build(*args: Any, **kwargs: Any) -> Any:
            with real_mode():
                return original(*args, **kwargs)
        return build

    from torch.distributed.device_mesh import DeviceMesh
    # the meshes made from a mesh: mesh["tp"] (a sub-mesh), FSDP2's DP x TP mesh of a parameter
    # tensor parallelism placed (_concatenate), flattened ones
    built = {name: DeviceMesh.__dict__[name] for name in ("__getitem__", "_concatenate", "_flatten", "_unflatten")
             if name in DeviceMesh.__dict__}
    for m, fn in saved:
        m._get_post_forward_mesh_info = outside_fake(fn)
    for name, fn in built.items():
        setattr(DeviceMesh, name, staticmethod(outside_fake(fn.__func__)) if isinstance(fn, staticmethod)
                else outside_fake(fn))
    try:
        yield
    finally:
        for name, fn in built.items():
            setattr(DeviceMesh, name, fn)
        for m, fn in saved:
            m._get_post_forward_mesh_info = fn


class _OneStream:
    """A CUDA stream or event where there is no GPU: FSDP2 orders its collectives with streams and
    events, which order work on the device but allocate nothing; the simulation runs in program
    order, which is the order FSDP2's events enforce."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> "_OneStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def record(self, *args: Any) -> "_OneStream":
        return self

    def record_event(self, *args: Any) -> "_OneStream":
        return self

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    wait_stream = wait_event = wait = synchronize = _nothing

    def query(self) -> bool:
        return True


class _HostStreams:
    """What FSDP2 reads of ``torch.cuda`` (its "device handle") for a CUDA mesh without a GPU."""

    Stream = Event = _OneStream
    _current = _OneStream()

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def current_stream(*args: Any) -> _OneStream:
        return _HostStreams._current

    @staticmethod
    def stream(s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def synchronize(*args: Any) -> None:
        return None


@contextlib.contextmanager
def fsdp_without_gpu(device: str) -> Iterator[None]:
    """FSDP2 on a CUDA mesh in a CUDA build of torch with no GPU (fxmem's fake tensors on
    ``device="cuda"``): FSDP2's modules get :class:`_HostStreams` as their CUDA device handle."""
    if device != "cuda" or torch.cuda.is_available():
        yield
        return
    try:
        from torch.distributed.fsdp._fully_shard import (_fsdp_collectives, _fsdp_init, _fsdp_param_group,
                                                         _fsdp_state)
    except ImportError:
        yield
        return
    modules = [m for m in (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state)
               if hasattr(m, "_get_device_handle")]
    saved = [(m, m._get_device_handle) for m in modules]

    def handle(device_type: str = "cuda", _original: Callable = saved[0][1] if saved else None) -> Any:
        return _HostStreams if device_type == "cuda" else _original(device_type)

    for m, _ in saved:
        m._get_device_handle = handle
    try:
        yield
    finally:
        for m, fn in saved:
            m._get_device_handle = fn


@contextlib.contextmanager
def on_storage_resize(callback: Any) -> Iterator[None]:
    """Call ``callback(storage, old_nbytes, new_nbytes)`` after every ``UntypedStorage.resize_``.

    Resizing a storage in place is an allocation (or a free) no aten op shows: FSDP2 frees its
    unsharded parameters with ``untyped_storage().resize_(0)`` and allocates them again with
    ``resize_(nbytes)``. The method is restored on exit."""
    cls = torch.UntypedStorage
    original = cls.__dict__.get("resize_")
    base = cls.resize_

    def resize_(self: Any, size: Any) -> Any:
        old = self.nbytes()
        out = base(self, size)
        callback(self, old, int(size))
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if original is None:
            del cls.resize_
        else:
            cls.resize_ = original


def fsdp_mem_tracker() -> type:
    """torch's ``FSDPMemTracker`` (``torch.distributed._tools``): its per-rank figures are what
    benchmarks/fsdp.py sets fxmem's beside."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    return FSDPMemTracker


def ddp_settings(model: torch.nn.Module) -> dict:
    """The keyword arguments a ``DistributedDataParallel`` was built with, as far as they decide
    its memory, and ``unsupported``: what fxmem cannot recreate, named."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    kw: dict = {"static_graph": bool(getattr(model, "static_graph", False))}
    # the constructor's flags, read back from the attributes of the same names (those this torch has;
    # broadcast_buffers is deprecated for forward_sync_buffers where that exists)
    for name in ("forward_sync_buffers", "find_unused_parameters", "gradient_as_bucket_view", "batched_grad_copy",
                 "skip_all_reduce_unused_params"):
        if name in accepted and hasattr(model, name):
            kw[name] = getattr(model, name)
    if "forward_sync_buffers" not in kw:
        kw["broadcast_buffers"] = model.broadcast_buffers
    if not getattr(model, "bucket_bytes_cap_default", False):
        kw["bucket_cap_mb"] = model.bucket_bytes_cap / 2 ** 20  # a power of two: exact
    caps = list(getattr(model, "bucket_bytes_cap_list", []) or [])
    if caps and "bucket_cap_mb_list" in accepted:
        kw["bucket_cap_mb_list"] = [c / 2 ** 20 for c in caps]
    unsupported = []
    if getattr(model, "mixed_precision", None) is not None:
        unsupported.append("mixed_precision=")
    if getattr(model, "_comm_hooks", None):
        unsupported.append("a communication hook (register_comm_hook)")
    if getattr(model, "_delay_all_reduce_params", None):
        unsupported.append("parameters whose all-reduce is delayed (delay_all_reduce_named_params=)")
    if getattr(model, "_use_python_reducer", False):
        unsupported.append("the Python reducer")
    return dict(kwargs=kw, ignore=set(getattr(model, "parameters_to_ignore", ()) or ()),
                world_size=model.process_group.size(), rank=model.process_group.rank(), unsupported=unsupported)


@contextlib.contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """Let ``DistributedDataParallel(...)`` be built on fake tensors: its start-up checks that every
    rank's parameters have the same shapes and broadcasts rank 0's values (C++ reading the data,
    which fake tensors do not have). Neither keeps memory; both are skipped while building."""
    import torch.nn.parallel.distributed as ddp

    saved = {name: getattr(ddp, name) for name in ("_verify_param_shape_across_processes", "_sync_module_states")
             if hasattr(ddp, name)}
    for name in saved:
        setattr(ddp, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ddp, name, fn)


class _ReducerWithoutRebuild:
    """DDP's reducer, except that it keeps its first bucket assignment: rebuilding it (in the order
    gradients arrived) broadcasts bucket indices as data fake tensors do not have. The rebuilt
    buckets hold the same parameters' bytes, allocated once; only their grouping differs."""

    def __init__(self, reducer: Any):
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


class _Made(DispatchMode):
    """Weak references to every tensor an op makes in here (see :func:`tensors_made`)."""

    def __init__(self, into: list) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.into.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def tensors_made() -> Iterator[list]:
    """A list that fills with weak references to the tensors made in here (by any op, also from
    C++: DDP's reducer allocates its buckets and maps in its constructor). Torch keeps a tensor's
    Python object alive as long as C++ holds the tensor, so the references that are alive
    afterwards are the tensors something kept."""
    made: list = []
    with _Made(made):
        yield made


def ddp_reducer_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of a DDP ``model``'s reducer, in its variable order (as
    ``DistributedDataParallel._build_params_for_reducer`` lists them: each module's own parameters
    that require grad and are not ignored, shared ones once)."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    seen: set = set()
    out = []
    for name, module in model.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{name}.{pname}" not in ignored and p not in seen:
                seen.add(p)
                out.append(p)
    return out


def ddp_used_map(model: torch.nn.Module) -> torch.Tensor | None:
    """The device side of a DDP ``model``'s map of which parameters got a gradient (int32, one per
    reducer parameter), which the reducer keeps where ``static_graph=True`` or
    ``find_unused_parameters=True``; None where it keeps none."""
    try:
        t = model.reducer._get_local_used_map()
    except Exception:  # noqa: BLE001 - a reducer without one (never initialised)
        return None
    return t if isinstance(t, torch.Tensor) and t.numel() else None


class _UsedMapReads(DispatchMode):
    """DDP's reducer reading its used-parameter map on fake tensors (see :func:`ddp_used_map_reads`)."""

    def __init__(self, params: list, device_map: torch.Tensor, host_map: torch.Tensor | None) -> None:
        super().__init__()
        self.params = params
        self.maps = {storage_key(device_map).cdata}
        if host_map is not None:
            self.maps.add(storage_key(host_map).cdata)

    def _is_map(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and storage_key(t).cdata in self.maps

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args and self._is_map(args[0]):
            return int(self.params[args[0].storage_offset()].grad is not None)
        if func is torch.ops.aten.copy_.default and len(args) > 1 and self._is_map(args[0]):
            self.maps.add(storage_key(args[1]).cdata)  # the map's other side (host <-> device)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def ddp_used_map_reads(model: torch.nn.Module, host_map: torch.Tensor | None = None) -> Iterator[None]:
    """Let a DDP ``model``'s reducer read its used-parameter map on fake tensors.

    With ``static_graph=True`` or ``find_unused_parameters=True`` the reducer asks, for each
    parameter after backward, ``local_used_map_[i].item() == 0`` ("did parameter i get no
    gradient?") to decide whether to write the reduced bucket back into its ``.grad``. A fake
    tensor has no value; the answer is whether parameter i's ``.grad`` is defined then: a parameter
    that got a gradient this step has one (the map says 1), and one that did not has none after
    ``zero_grad(set_to_none=True)`` (the map says 0). Where a ``.grad`` of zeros was kept
    (``set_to_none=False``) the answer can differ from the map's, but then either answer
    allocates nothing: the bucket is copied into the existing ``.grad``, or it is left alone.
    ``host_map``: the reducer's host-side map where known (the device side is found from the
    reducer, the host side also from the copies between them)."""
    device_map = ddp_used_map(model)
    if device_map is None:
        yield
        return
    with _UsedMapReads(ddp_reducer_params(model), device_map, host_map):
        yield


def ddp_keep_buckets(model: torch.nn.Module) -> None:
    """See :class:`_ReducerWithoutRebuild` (``model`` is fxmem's fake DDP copy)."""
    model.reducer = _ReducerWithoutRebuild(model.reducer)


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of a real DDP model's gradient buckets, as DDP's own logging data counts them (0 if
    ``model`` is not DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(v) for v in sizes.split(",") if v.strip())
