"""transformers' key/value cache: what ``optimize`` does with a model that returns one.

A transformers causal LM configured with ``use_cache=True`` (its config's default) returns its
key/value cache (``past_key_values``, a ``DynamicCache``) from every call that does not pass
``use_cache``. No graph returns a class, so such a model could not be captured for a rewrite. The
cache serves generation only; training, where memory decides, runs without it. So the model is
rewritten as it computes with ``use_cache=False``: a private copy whose config says so (sharing
every tensor; the user's model and config are untouched), verified against the original called
the same way, and a ``meta["fxmem"]`` entry (rule ``"use_cache"``) says the cache is not returned.

>>> model, entry = without_cache(llama, ["attention_mask", "use_cache"], "LlamaForCausalLM")  # doctest: +SKIP
>>> entry["reason"]                                                                      # doctest: +SKIP
'applied: use_cache=False - the same outputs, without the key/value cache (past_key_values)'
"""
from __future__ import annotations

from typing import Sequence

import torch

from fxmem.capture import private_copy
from fxmem.passes.base import log_entry

__all__ = ["without_cache"]


def without_cache(model: torch.nn.Module, unset: Sequence[str], name: str) -> tuple[torch.nn.Module, dict | None]:
    """``(model, None)``, or, where ``model`` returns a key/value cache because its config says
    ``use_cache=True`` and the call leaves ``use_cache`` unset (``unset``: the forward's arguments
    without an input), a copy computing with ``use_cache=False`` and the log entry saying so."""
    config = getattr(model, "config", None)
    if "use_cache" not in unset or getattr(config, "use_cache", None) is not True:
        return model, None
    twin = private_copy(model)
    twin.config.use_cache = False  # the copy's own config, which its submodules share (one deepcopy)
    details = (f"{name}'s config has use_cache=True (transformers' default), so every call returns its key/value "
               f"cache (past_key_values), a class no graph can return. The result computes with use_cache=False: "
               f"the same outputs and gradients (verified against {name} called that way), without the cache - as "
               f"in training. To generate with a cache, call the original model; to keep this choice explicit, "
               f"set model.config.use_cache = False before optimize")
    return twin, log_entry("use_cache", "applied", name, "applied: use_cache=False - the same outputs, without the "
                           "key/value cache (past_key_values)", details=details)
