"""Named training recipes: the precision a training step keeps its model states in and runs its
forward in, as data, for :func:`fxmem.llm_answer` (``recipe=``) and ``fxmem llm --recipe``.

A recipe says (dtypes by name, so the registry loads without torch: ``fxmem --help`` lists it): the
dtype the parameters are built in, the dtype ``torch.autocast`` runs the
forward in (or None), where the float32 master weights live, the optimizer state's dtype (torch's
optimizers keep their moments in the parameters' dtype), whether the base is frozen with LoRA
adapters, and whether the loss is scaled (``torch.amp.GradScaler``, for float16). From these come
the bytes per parameter of model states (parameters + gradients + optimizer state):

>>> RECIPES["amp-bf16"].bytes_per_parameter()          # float32 weights, grads, 2 AdamW moments
16
>>> RECIPES["bf16"].bytes_per_parameter()              # everything bfloat16
8
>>> RECIPES["lora"].bytes_per_parameter(), RECIPES["lora"].frozen_bytes_per_parameter()
(16, 2)

Names that need bitsandbytes (8-bit AdamW, 4-bit QLoRA) are known and refused with the reason:
fxmem does not approximate what it cannot simulate.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from typing import TYPE_CHECKING, Any, Callable

from .errors import ModelError, SpecError

if TYPE_CHECKING:
    import torch

__all__ = ["Recipe", "RECIPES", "REFUSED", "get", "for_dtype", "NAMES"]

# optimizer state tensors per trainable parameter element (their dtype is the parameter's)
STATES_PER_PARAMETER = {"adamw": 2, "adam": 2, "sgd": 1}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each dtype a recipe names


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training recipe (bytes are bytes; dtypes are names of torch dtypes, ``"bfloat16"``).

    ``parameters``: the dtype every parameter is built in (for ``lora``, the frozen base's);
    ``trainable``: the dtype of the parameters that train (the master weights where they are
    float32 and the forward runs in half precision); ``autocast``: the forward's
    ``torch.autocast`` dtype, or None; ``master_weights``: where float32 master weights live, in
    words; ``lora``: the base is frozen and peft LoRA adapters train; ``loss_scaling``: the step
    scales the loss with ``torch.amp.GradScaler`` (float16's range needs it).

    >>> RECIPES["amp-fp16"].autocast, RECIPES["amp-fp16"].dtype("autocast")
    ('float16', torch.float16)
    """

    name: str
    parameters: str
    trainable: str
    autocast: str | None
    master_weights: str
    description: str
    lora: bool = False
    loss_scaling: bool = False

    @property
    def optimizer_state(self) -> str:
        """The optimizer state's dtype: torch's optimizers create it like the trained parameters."""
        return self.trainable

    def dtype(self, field: str) -> "torch.dtype | None":
        """The torch dtype of ``field`` (``"parameters"``, ``"trainable"``, ``"autocast"``), or None."""
        import torch

        name = getattr(self, field)
        return getattr(torch, name) if name is not None else None

    def bytes_per_parameter(self, optimizer: str = "adamw") -> int:
        """Model-state bytes per trained parameter: the weight, its gradient and ``optimizer``'s state
        (AdamW: two moments). ``RECIPES["fp32"].bytes_per_parameter("sgd")`` is 12."""
        if optimizer not in STATES_PER_PARAMETER:
            raise SpecError(f"optimizer={optimizer!r}: use one of {sorted(STATES_PER_PARAMETER)}")
        return ITEMSIZE[self.trainable] * (2 + STATES_PER_PARAMETER[optimizer])

    def frozen_bytes_per_parameter(self) -> int:
        """Bytes per frozen (base) parameter: the weight alone, no gradient, no optimizer state."""
        return ITEMSIZE[self.parameters]

    def summary(self, optimizer: str = "adamw") -> str:
        """One line: the description and the bytes per parameter of model states."""
        per = f"{self.bytes_per_parameter(optimizer)} B per trained parameter with {optimizer}"
        if self.lora:
            per += f", {self.frozen_bytes_per_parameter()} B per frozen base parameter"
        return f"{self.name}: {self.description} ({per})"


def _pure(name: str, dtype: str, why: str = "") -> Recipe:
    return Recipe(name, dtype, dtype, None, "the parameters (float32)" if dtype == "float32" else "none",
                  f"pure {dtype}: parameters, gradients and optimizer state all {dtype}, no autocast{why}")


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _pure("fp32", "float32"),
    _pure("bf16", "bfloat16"),
    _pure("fp16", "float16", "; no loss scaling (rarely trained this way)"),
    Recipe("amp-bf16", "float32", "float32", "bfloat16", "the parameters (float32)",
           "torch AMP: float32 parameters (the master weights), gradients and optimizer state; the forward "
           "under torch.autocast(dtype=torch.bfloat16)"),
    Recipe("amp-fp16", "float32", "float32", "float16", "the parameters (float32)",
           "torch AMP: float32 parameters (the master weights), gradients and optimizer state; the forward "
           "under torch.autocast(dtype=torch.float16), the loss scaled by torch.amp.GradScaler",
           loss_scaling=True),
    Recipe("lora", "bfloat16", "float32", "bfloat16", "the adapters (float32); the base has none",
           "LoRA: the base frozen in bfloat16, peft adapters, their gradients and optimizer state in float32; "
           "the forward under torch.autocast(dtype=torch.bfloat16)", lora=True),
)}

# names users ask for that need bitsandbytes: known, and refused with the reason
REFUSED = {
    "adamw-8bit": "bitsandbytes' 8-bit AdamW (bnb.optim.AdamW8bit)",
    "qlora": "a 4-bit base (bitsandbytes' Linear4bit, QLoRA)",
}

NAMES = (*RECIPES, *REFUSED)


def get(name: str) -> Recipe:
    """The recipe called ``name`` (a :class:`Recipe` is returned as it is); an unknown name or one
    fxmem cannot simulate is refused (the argument named, the names it knows listed).

    >>> get("amp-bf16").parameters
    'float32'
    """
    if isinstance(name, Recipe):
        return name
    if name in RECIPES:
        return RECIPES[name]
    if name in REFUSED:
        raise ModelError(f"recipe={name!r} needs {REFUSED[name]}: {_bitsandbytes_state()}, and fxmem does not "
                         f"approximate what it cannot simulate. Use one of {', '.join(RECIPES)} "
                         f"(e.g. 'lora' for a bfloat16 frozen base with float32 adapters)")
    close = difflib.get_close_matches(str(name), NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SpecError(f"recipe={name!r} is not a recipe{hint}; use one of {', '.join(RECIPES)}")


def _bitsandbytes_state() -> str:
    """Why a bitsandbytes recipe cannot be analysed here, in words."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    # installed: its quantize / 8-bit optimizer kernels are native code with no fake-tensor
    # implementation checked against real runs, so a simulation would be a guess
    return "bitsandbytes is installed, but its kernels have no fake-tensor implementation fxmem has checked " \
           "against real runs"


def for_dtype(dtype: "torch.dtype") -> Recipe | None:
    """The pure recipe of ``dtype`` (what a model built in ``dtype`` trains as without a recipe), or
    None where there is none. ``for_dtype(torch.bfloat16).name`` is ``'bf16'``."""
    name = str(dtype).replace("torch.", "")
    return next((r for r in RECIPES.values() if r.autocast is None and r.parameters == name), None)


def parameters_to(model: "torch.nn.Module", dtype: "torch.dtype",
                  which: Callable[["torch.nn.Parameter"], bool] = lambda p: True) -> None:
    """Convert ``model``'s floating parameters (those ``which`` picks) to ``dtype`` in place; the
    buffers keep theirs (a rotary ``inv_freq`` is float32 in a model loaded in any dtype, and
    ``model.to(dtype)`` would change it). A parameter shared by two modules (tied embeddings)
    stays one parameter."""
    import torch

    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if not p.is_floating_point() or p.dtype == dtype or not which(p):
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module.register_parameter(key, done[id(p)])


def scaled_step(device: str, dtype: "torch.dtype") -> Callable[..., Any]:
    """The float16 AMP step as torch's documentation writes it, for ``analyze(step=...)``:

        with torch.autocast(device, dtype=torch.float16):
            loss = model(input_ids, attention_mask)
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
        optimizer.zero_grad(set_to_none=True)

    The scaler is one per step function (its scale and growth tracker stay between steps, 8 bytes);
    fxmem puts its state back after simulating."""
    import torch

    scaler = torch.amp.GradScaler(device)

    def amp_step(model: Any, optimizer: torch.optim.Optimizer, *inputs: Any) -> None:
        with torch.autocast(device, dtype=dtype):
            loss = model(*inputs)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return amp_step
