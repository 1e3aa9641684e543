"""Every use of private PyTorch API in fxmem lives in this package, one module per torch subsystem, so
a torch upgrade touches this folder only, and a break in one subsystem is read in its own module:

* :mod:`.ops` - op objects (``OpOverload``) and their schemas, Python dispatch modes, pytree, ATen's
  Python decompositions and layout helpers: kernel rules are keyed by op and read arguments by name.
* :mod:`.fake` - ``FakeTensorMode`` and ``ShapeEnv``: running a model on fake tensors whose sizes are
  ``SymInt`` gives each storage's size as a sympy expression without allocating anything; size
  symbols, guards, torch's sympy functions converted to plain sympy; ``StorageWeakRef`` (when a
  storage died, i.e. when the real allocator would free it).
* :mod:`.fx` - TorchDynamo (what a captured graph was traced with, its guards, its cache of
  compiled frames) and higher-order operators.
* :mod:`.modules` - ``nn.Module`` internals: a structural copy of a model whose tensors are fake,
  module hooks, parameter initialisation switched off while a model is built.
* :mod:`.autograd` - saved-tensor hooks, the running backward node, tensor hooks, view metadata,
  the profiler's flag.
* :mod:`.devices` - CUDA builds and the CUDA caching allocator's history; ATen's CPU capability.
* :mod:`.conv_backend` - ATen's convolution backend question (``_select_conv_backend``), which
  torch's fake convolution asks only for the output's memory format: asked without guards where
  every backend gives the same format, so a CNN's formulas are not cut at batch 16.
* :mod:`.distributed` - c10d and the fake process group, DTensor, FSDP1/FSDP2, DDP,
  ``FSDPMemTracker``, storage resizes (imported inside functions only: ``torch.distributed`` is
  never loaded by importing fxmem).
* :mod:`.pipelining` - ``torch.distributed.pipelining``'s schedules and stages, and their start-up
  messages (the vote on the inference mode, the metadata objects) answered in one process.

Each module's docstring says what it wraps and what breaks there on a torch upgrade. They import
each other only downwards (``ops``; ``fake`` imports ``ops``; ``fx`` and ``distributed`` import
``fake``; ``modules``, ``autograd``, ``devices``, ``conv_backend``, ``pipelining`` import none; ``fake`` uses
``conv_backend`` too), never this file.

The rest of fxmem imports this package as ``tc`` (``from .. import _torch_compat as tc``) and calls
``tc.<name>``: every name is re-exported here, and nothing else is here.
``tests/package/test_torch_compat.py`` fails when any module outside this folder touches private torch API,
and when this file holds anything but re-exports.

Supported: torch 2.5 and newer.
"""
from __future__ import annotations

from .ops import (
    NUMBERS,
    DispatchMode,
    argument_names,
    bind_arguments,
    is_op,
    matmul_decomposition,
    mutates,
    non_overlapping_and_dense,
    op_name,
    op_packet,
    op_packet_name,
    plain_number,
    python_number_in_tensor_slot,
    real_mode,
    record_function_ops,
    scalar_args,
    suggest_memory_format,
    tensor_iterator_operands,
    torch_release,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
    upsample_bindings,
    written_tensors,
)
from .fake import (
    DATA_DEPENDENT_ERRORS,
    UNSUPPORTED_OP_ERRORS,
    FakeTensor,
    _FakeMode,
    expired_keys,
    is_fake,
    known_true,
    lower_bound,
    make_dim_symbol,
    make_symint,
    new_fake_mode,
    optimizers_treat_fake_as_real,
    pin_symbols,
    pinned_dims,
    plain_sympy,
    quiet_torch_logs,
    raw_expr,
    replacements,
    shape_guards,
    simplify,
    size_expr,
    size_hint,
    storage_key,
    storage_nbytes,
    storage_weakref,
    symbol_hints,
    symbol_lower_bound,
    symbol_upper_bound,
    unbacked_symbols,
    watch_storage,
)
from .fx import (
    dynamo_cache_entries,
    dynamo_example_value,
    dynamo_input_sizes,
    dynamo_shape_guards,
    dynamo_wrapped_number,
    forget_compiled,
    is_compiled_function,
    is_higher_order_op,
    side_effect,
)
from .modules import (
    add_hook,
    fake_module_copy,
    global_hook_tables,
    hook_tables,
    module_attribute_values,
    module_hooks,
    non_persistent_buffers,
    order_like,
    pop_child,
    skip_parameter_init,
    tensor_attributes,
)
from .autograd import (
    backward_calls,
    in_python_backward,
    is_view,
    profiler_active,
    saved_tensor_hooks,
    saved_tensor_hooks_in_effect,
    tensor_hooks,
    tensor_use_count,
    view_base,
    write_count,
)
from .devices import cpu_capability, cuda_memory_history, fake_cuda_backward_possible, fake_cuda_is_safe
from .distributed import (
    ddp_bucket_bytes,
    ddp_keep_buckets,
    ddp_on_fake_tensors,
    ddp_reducer_params,
    ddp_settings,
    ddp_used_map,
    ddp_used_map_reads,
    distributed_available,
    dtensor_propagation_quiet,
    dtensor_type,
    attention_ops,
    context_parallel_active,
    dtensor_shards,
    dtensor_type_if_loaded,
    fake_process_group,
    fsdp1_type,
    fsdp2_groups,
    fsdp2_lazy_init,
    fsdp2_managed,
    fsdp2_set_knobs,
    fsdp2_state,
    fsdp2_unsharded_copy,
    fsdp_mem_tracker,
    fsdp_meshes_outside_fake,
    fsdp_without_gpu,
    functional_collective,
    import_parallel_packages,
    local_tensor,
    on_storage_resize,
    pipeline_stage_types,
    tensors_made,
)

from .pipelining import (
    is_pipeline_schedule,
    is_pipelining_refusal,
    messages as pipeline_messages,
    pipeline_schedule_type,
    schedule_microbatches,
    schedule_stages,
    sends as pipeline_sends,
    stage_buffers,
    stage_index,
    stage_static_vote,
)

# the names fxmem calls as ``tc.<name>``, and ``_FakeMode`` (tests build one)
__all__ = [
    # ops
    "NUMBERS", "DispatchMode", "argument_names", "bind_arguments", "is_op", "matmul_decomposition", "mutates",
    "non_overlapping_and_dense", "op_name", "op_packet", "op_packet_name", "plain_number",
    "python_number_in_tensor_slot", "real_mode", "record_function_ops", "scalar_args", "suggest_memory_format",
    "tensor_iterator_operands", "torch_release", "tree_flatten", "tree_leaves", "tree_unflatten",
    "upsample_bindings", "written_tensors",
    # fake
    "DATA_DEPENDENT_ERRORS", "UNSUPPORTED_OP_ERRORS", "FakeTensor", "_FakeMode", "expired_keys", "is_fake", "known_true",
    "lower_bound", "make_dim_symbol", "make_symint", "new_fake_mode", "optimizers_treat_fake_as_real",
    "pin_symbols", "pinned_dims", "plain_sympy", "quiet_torch_logs", "raw_expr", "replacements", "shape_guards",
    "simplify", "size_expr", "size_hint", "storage_key", "storage_nbytes", "storage_weakref", "symbol_hints",
    "symbol_lower_bound", "symbol_upper_bound", "unbacked_symbols", "watch_storage",
    # fx
    "dynamo_cache_entries", "dynamo_example_value", "dynamo_input_sizes", "dynamo_shape_guards",
    "dynamo_wrapped_number", "forget_compiled", "is_compiled_function", "is_higher_order_op", "side_effect",
    # modules
    "add_hook", "fake_module_copy", "global_hook_tables", "hook_tables", "module_attribute_values", "module_hooks",
    "non_persistent_buffers", "order_like", "pop_child", "skip_parameter_init", "tensor_attributes",
    # autograd
    "backward_calls", "in_python_backward", "is_view", "profiler_active", "saved_tensor_hooks", "view_base",
    "saved_tensor_hooks_in_effect", "tensor_hooks", "tensor_use_count", "write_count",
    # devices
    "cpu_capability", "cuda_memory_history", "fake_cuda_backward_possible", "fake_cuda_is_safe",
    # distributed
    "ddp_bucket_bytes", "ddp_keep_buckets", "ddp_on_fake_tensors", "ddp_reducer_params", "ddp_settings",
    "ddp_used_map", "ddp_used_map_reads", "distributed_available", "dtensor_propagation_quiet", "dtensor_type",
    "attention_ops", "context_parallel_active", "dtensor_shards", "dtensor_type_if_loaded", "fake_process_group", "fsdp1_type", "fsdp2_groups", "fsdp2_lazy_init", "fsdp2_managed",
    "fsdp2_set_knobs", "fsdp2_state", "fsdp2_unsharded_copy", "fsdp_mem_tracker", "fsdp_meshes_outside_fake",
    "fsdp_without_gpu", "functional_collective", "import_parallel_packages", "local_tensor", "on_storage_resize",
    "pipeline_stage_types", "tensors_made",
    # pipelining
    "is_pipeline_schedule", "is_pipelining_refusal", "pipeline_messages", "pipeline_schedule_type", "pipeline_sends",
    "schedule_microbatches", "schedule_stages", "stage_buffers", "stage_index", "stage_static_vote",
]
