"""``optimize(budget=)`` on transformers as libraries write them: layers inside an ``nn.Sequential``
or ``nn.ModuleList`` (timm's ViT and Swin, Hugging Face's decoders) are the blocks recomputed, as
the libraries' own checkpointing recomputes them (passes/segments.py).

Independent evidence: the recomputed model's real training step, measured by the CPU allocator at
the budget's dims, is within the budget and equal to fxmem's prediction; its outputs and gradients
equal the model's in train and eval mode."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from fxmem.passes.segments import blocks
from conftest import check_training_against_real_run
from equivalence import assert_same_in_every_mode
from zoo import Logits
from test_recompute import _measured_step_peak, sgd


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    """timm's ViT block: pre-norm attention and MLP, each with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int = 4) -> None:
        super().__init__()
        self.proj, self.norm = nn.Conv2d(3, dim, patch, patch), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class ViT(nn.Module):
    """timm's VisionTransformer's layout: patch embedding, class token, ``blocks`` an nn.Sequential."""

    def __init__(self, dim: int = 32, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.norm(self.blocks(x))[:, 0])


class Stage(nn.Module):
    """Swin's stage: a patch merging (after the first stage), then ``blocks`` an nn.Sequential."""

    def __init__(self, dim: int, depth: int, merge: bool) -> None:
        super().__init__()
        self.downsample = nn.Sequential(nn.LayerNorm(dim // 2), nn.Linear(dim // 2, dim)) if merge else nn.Identity()
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class Swin(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.layers = nn.Sequential(Stage(dim, 2, False), Stage(2 * dim, 2, True))
        self.head = nn.Linear(2 * dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.patch_embed(x)).mean(1))


def _names(model: nn.Module) -> list[str]:
    from fxmem.passes.modes import trace_modes

    return [b.name for b in blocks(trace_modes(model).graph_module)]


def _fits_for_real(model: nn.Module, spec: tuple, dims: dict, fraction: float, unseen: dict, sample: torch.Tensor):
    """``optimize`` with a budget of ``fraction`` of the model's training-step peak at ``dims``: the
    result's real step there is within it, its prediction equal to a real step at ``unseen``, and it
    computes the model's outputs and gradients in every mode on ``sample``. Returns the result."""
    base = fxmem.analyze(model, spec, optimizer=sgd).evaluate(**dims)["train_peak"]
    budget = int(base * fraction)
    opt = fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=sgd)
    report = check_training_against_real_run(opt.train(), (spec,), [unseen], sgd, num_threads=1)
    assert _measured_step_peak(opt, report, dims) <= budget
    assert_same_in_every_mode(model, opt, [sample])
    return opt


def test_the_layers_inside_containers_are_the_blocks_not_the_container_nor_a_layers_parts():
    # timm's ViT: blocks.0..3, not "blocks" (one block of them all would bring every layer's
    # activations back at once); a block's two LayerNorms are no stack of layers
    assert _names(ViT()) == ["patch_embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    # Swin: the stages' blocks, two containers deep, and the merging between them
    assert _names(Swin()) == ["patch_embed", "layers.0.blocks.0", "layers.0.blocks.1", "layers.1.downsample",
                              "layers.1.blocks.0", "layers.1.blocks.1"]


def test_a_budget_on_a_vit_recomputes_its_layers_and_holds_on_a_real_step():
    torch.manual_seed(0)
    model = ViT()
    opt = _fits_for_real(model, ("B", 3, 32, 32), dict(B=32), 0.6, dict(B=5), torch.randn(3, 3, 32, 32))
    entry = opt.meta["fxmem"][-1]
    assert (entry["rule"], entry["status"]) == ("recompute", "applied"), entry
    assert {name for name, _ in entry["plan"]} <= {f"blocks.{k}" for k in range(4)} | {"patch_embed"}, entry["plan"]


def test_a_budget_on_a_hugging_face_decoder_recomputes_its_layers_and_holds_on_a_real_step():
    """HF's LlamaForCausalLM: model.layers (an nn.ModuleList the model loops over) are the blocks;
    the step fxmem plans on is the model's own (its captured graph given back is_causal and
    enable_gqa, which HF's code drops under tracing: sdpa-flags), so the budget is neither missed
    nor too strict."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids, dims = fxmem.TensorSpec(("B", "L"), dtype=torch.int64), dict(B=4, L=128)
    own = fxmem.analyze(model, ids, optimizer=sgd)
    budget = int(own.evaluate(**dims)["train_peak"] * 0.6)
    opt = fxmem.optimize(model, ids, budget=budget, dims=dims, optimizer=sgd)
    log = opt.meta["fxmem"]
    assert [e["status"] for e in log if e["rule"] == "sdpa-flags"] == ["applied"] * 3, log
    entry = log[-1]
    assert (entry["rule"], entry["status"]) == ("recompute", "applied"), entry
    assert {name for name, _ in entry["plan"]} <= {f"model.layers.{k}" for k in range(3)} | {"model.rotary_emb",
                                                                                              "model.norm"}
    # the step planned on is the model's own: its peak before equals the model's real step
    assert entry["peak_at_dims_before"] == _measured_step_peak(model, own, dims)
    report = fxmem.analyze(opt, ids, optimizer=sgd)
    assert _measured_step_peak(opt, report, dims) == report.evaluate(**dims)["train_peak"] <= budget
    assert_same_in_every_mode(Logits(model), Logits(opt), [torch.randint(0, 64, (2, 9))])


class DropPathBlock(Block):
    """timm's drop path (stochastic depth) on the attention branch: ``x.new_empty(...).bernoulli_(keep)``
    changes in place a tensor the block itself made, and an in-place ReLU on its own intermediate."""

    def __init__(self, dim: int, p: float = 0.2) -> None:
        super().__init__(dim)
        self.p = p
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(inplace=True), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0], 1, 1)).bernoulli_(keep).div_(keep)
        x = x + self.attn(self.norm1(x)) * mask
        return x + self.mlp(self.norm2(x))


class InputChanger(nn.Module):
    """A block that changes its input in place: recomputing it would change it twice."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x).relu()


def test_in_place_changes_of_what_a_block_made_do_not_stop_its_recomputation():
    # the random mask is drawn again in backward from the state the checkpoint kept: the same
    # gradients as the model's own step (train mode, the same seed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *[DropPathBlock(32) for _ in range(3)])
    opt = _fits_for_real(model, ("B", "N", 32), dict(B=16, N=64), 0.7, dict(B=5, N=9), torch.randn(3, 7, 32))
    entry = opt.meta["fxmem"][-1]
    assert (entry["rule"], entry["status"]) == ("recompute", "applied"), entry
    # a block that changes its input in place is still refused, with the reason
    from fxmem.passes.modes import trace_modes

    refused = blocks(trace_modes(nn.Sequential(InputChanger(8), InputChanger(8))).graph_module)
    assert refused and all("from outside the block" in (b.refusal or "") for b in refused), refused


class DropPath(nn.Module):
    """timm's DropPath: the residual branch dropped per sample in training, nothing in eval mode -
    ``if not self.training``, so the two modes run other code (two traces)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)


class DepthBlock(Block):
    def __init__(self, dim: int, p: float = 0.2) -> None:
        super().__init__(dim)
        self.drop_path = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def test_a_budget_on_a_model_whose_modes_run_other_code_recomputes_its_train_mode_graph():
    # timm's stochastic depth (Swin, ConvNeXt, ViTs with drop_path_rate > 0): the train-mode trace's
    # blocks are recomputed, the eval-mode trace runs as traced; every mode still computes the model's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *[DepthBlock(32) for _ in range(3)])
    opt = _fits_for_real(model, ("B", "N", 32), dict(B=16, N=64), 0.7, dict(B=5, N=9), torch.randn(3, 7, 32))
    entry = next(e for e in opt.meta["fxmem"] if e["rule"] == "recompute")
    assert entry["status"] == "applied" and "train-mode graph" in entry["details"], entry
    assert any(e["rule"] == "train/eval" for e in opt.meta["fxmem"])


def test_a_selective_plan_that_cannot_be_analysed_falls_back_to_whole_recomputation(monkeypatch):
    # timm's Swin: torch's selective checkpoint cannot match its recomputed slices on fake tensors,
    # so a plan with selective blocks cannot be analysed - the budget is then fitted by whole
    # recomputation, not refused (here the failure is made by the test, on a plan it would choose)
    from fxmem.passes import recompute

    trial, failed = recompute._Planner.trial, []

    def failing(self, plan, known=None):
        if any(how == "selective" for _, how in plan):
            failed.append(plan)
            raise recompute.BudgetError("cannot be analysed (made to fail by the test)", 0, {})
        return trial(self, plan, known)

    monkeypatch.setattr(recompute._Planner, "trial", failing)
    torch.manual_seed(0)
    model = ViT()
    opt = _fits_for_real(model, ("B", 3, 32, 32), dict(B=32), 0.9, dict(B=5), torch.randn(3, 3, 32, 32))
    entry = opt.meta["fxmem"][-1]
    assert failed and entry["status"] == "applied" and all(how == "whole" for _, how in entry["plan"]), entry
