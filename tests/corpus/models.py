"""Third-party models, built from configs with random weights (nothing is downloaded), small enough
for CI: Hugging Face transformers, PyTorch Geometric layers, timm and torchvision.

Each entry of :data:`CORPUS` is a :class:`Entry`: how to build the model, its input specs, the
mode fxmem analyses it in (the default ``"auto"``: graph where torch.fx traces the library's code,
else the original forward, and the report says which), input
makers for inputs whose values matter (token ids, edge lists), and two held-out sizes including
batch 1. ``requires`` names the package; an entry whose package is missing is skipped.

>>> entry = CORPUS["gpt2"]; model = entry.build()          # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Callable

import torch
import torch.nn as nn

import fxmem

VOCAB = 100


@dataclasses.dataclass
class Entry:
    build: Callable[[], nn.Module]
    specs: tuple
    sizes: list
    requires: str
    mode: str = "auto"
    makers: dict = dataclasses.field(default_factory=dict)
    data: Callable[[list], dict] | None = None  # the values of sizes the data decides, from the inputs

    def available(self) -> bool:
        return importlib.util.find_spec(self.requires) is not None


def tokens(shape: tuple, dims: dict) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape)


def edges(shape: tuple, dims: dict) -> torch.Tensor:
    return torch.randint(0, dims["N"], shape)


def ones(shape: tuple, dims: dict) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.int64)


class HiddenStates(nn.Module):
    """A transformers model called with token ids, returning its last hidden state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).last_hidden_state


class EncoderDecoderStates(HiddenStates):
    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).last_hidden_state


class MaskedStates(HiddenStates):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ImageStates(HiddenStates):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


_WRAPPERS = {("input_ids",): HiddenStates, ("input_ids", "decoder_input_ids"): EncoderDecoderStates,
             ("input_ids", "attention_mask"): MaskedStates,
             ("pixel_values",): ImageStates}


def _hf(config_cls: str, model_cls: str, names: tuple = ("input_ids",), attention: str = "eager",
        **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(attn_implementation=attention, **config)
        torch.manual_seed(0)
        return _WRAPPERS[names](getattr(transformers, model_cls)(cfg))

    return build


IDS = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
SMALL = dict(vocab_size=VOCAB)
SIZES = [dict(B=1, L=7), dict(B=2, L=12)]


def _pyg(layer: str, *args: Any, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torch_geometric.nn as gnn

        torch.manual_seed(0)
        if layer == "GINConv":
            return gnn.GINConv(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32)))
        return getattr(gnn, layer)(*args, **kw)

    return build


GRAPH = (("N", 16), fxmem.TensorSpec((2, "E"), dtype=torch.int64))
GRAPH_SIZES = [dict(N=1, E=3), dict(N=9, E=30)]
DENSE = (("B", "N", 16), ("B", "N", "N"))
DENSE_SIZES = [dict(B=1, N=5), dict(B=2, N=9)]

# PyG's GCNConv, GATConv and GATv2Conv add self loops after removing the existing ones: the number
# of edges kept depends on the edge list's values, a dim of the formulas (K1) whose value the test
# counts from the real edge list. The corpus has them with and without their default self loops.
NO_LOOPS = dict(add_self_loops=False)


def edges_kept(inputs: list) -> dict:
    """K1 of PyG's default self-loop handling: the edges that are not loops."""
    edge_index = inputs[1]
    return {"K1": int((edge_index[0] != edge_index[1]).sum())}

class PatchifyStem(nn.Module):
    """ConvNeXt's stem: a 4x4 stride-4 patchify conv, then channels-last LayerNorm and Linear."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.fc(self.norm(self.stem(image).permute(0, 2, 3, 1)))
        return x.reshape(x.shape[0], -1, x.shape[-1])


CORPUS: dict[str, Entry] = {
    "convnext-stem": Entry(PatchifyStem, (("B", 3, "S", "S"),), [dict(B=1, S=16), dict(B=2, S=36)], "torch"),
    "mixtral-moe": Entry(_hf("MixtralConfig", "MixtralModel", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=256, **SMALL), (IDS,), SIZES, "transformers"),
    "clip-text": Entry(_hf("CLIPTextConfig", "CLIPTextModel", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77, bos_token_id=0,
                           eos_token_id=1, pad_token_id=1, **SMALL), (IDS,), SIZES, "transformers"),
    "gpt2": Entry(_hf("GPT2Config", "GPT2Model", n_embd=32, n_layer=2, n_head=4, n_positions=256,
                      bos_token_id=0, eos_token_id=0, **SMALL), (IDS,), SIZES, "transformers"),
    "bert": Entry(_hf("BertConfig", "BertModel", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=256, **SMALL), (IDS,), SIZES, "transformers"),
    "llama": Entry(_hf("LlamaConfig", "LlamaModel", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, **SMALL),
                   (IDS,), SIZES, "transformers"),
    "llama-mask": Entry(_hf("LlamaConfig", "LlamaModel", ("input_ids", "attention_mask"), hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=256, **SMALL), (IDS, IDS), SIZES, "transformers"),
    "llama-sdpa-mask": Entry(_hf("LlamaConfig", "LlamaModel", ("input_ids", "attention_mask"), attention="sdpa",
                                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, max_position_embeddings=256, **SMALL), (IDS, IDS), SIZES,
                             "transformers"),
    "llama-sdpa-mask-filled": Entry(_hf("LlamaConfig", "LlamaModel", ("input_ids", "attention_mask"),
                                        attention="sdpa", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                        **SMALL),
                                    (IDS, fxmem.TensorSpec(("B", "L"), dtype=torch.int64, fill=1)), SIZES,
                                    "transformers"),
    "bart": Entry(_hf("BartConfig", "BartModel", d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, max_position_embeddings=256, **SMALL), (IDS,), SIZES, "transformers"),
    "t5": Entry(_hf("T5Config", "T5Model", ("input_ids", "decoder_input_ids"), d_model=32, d_kv=8, d_ff=64,
                    num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, **SMALL),
                (IDS, IDS), SIZES, "transformers"),
    "vit": Entry(_hf("ViTConfig", "ViTModel", ("pixel_values",), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8),
                 ((("B", 3, 32, 32)),), [dict(B=1), dict(B=3)], "transformers"),
    "distilbert": Entry(_hf("DistilBertConfig", "DistilBertModel", dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                            max_position_embeddings=256, **SMALL), (IDS,), SIZES, "transformers"),
    "qwen2": Entry(_hf("Qwen2Config", "Qwen2Model", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, **SMALL),
                   (IDS,), SIZES, "transformers"),
    "pyg-gcn": Entry(_pyg("GCNConv", 16, 32, **NO_LOOPS), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-gat": Entry(_pyg("GATConv", 16, 8, heads=4, **NO_LOOPS), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-gatv2": Entry(_pyg("GATv2Conv", 16, 8, heads=4, **NO_LOOPS), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-gcn-default": Entry(_pyg("GCNConv", 16, 32), GRAPH, GRAPH_SIZES, "torch_geometric", data=edges_kept),
    "pyg-gat-default": Entry(_pyg("GATConv", 16, 8, heads=4), GRAPH, GRAPH_SIZES, "torch_geometric",
                             data=edges_kept),
    "pyg-gatv2-default": Entry(_pyg("GATv2Conv", 16, 8, heads=4), GRAPH, GRAPH_SIZES, "torch_geometric",
                               data=edges_kept),
    "pyg-sage": Entry(_pyg("SAGEConv", 16, 32), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-gin": Entry(_pyg("GINConv"), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-transformer": Entry(_pyg("TransformerConv", 16, 8, heads=4), GRAPH, GRAPH_SIZES, "torch_geometric"),
    "pyg-dense-gat": Entry(_pyg("DenseGATConv", 16, 8, heads=4), DENSE, DENSE_SIZES, "torch_geometric"),
    "pyg-dense-gcn": Entry(_pyg("DenseGCNConv", 16, 32), DENSE, DENSE_SIZES, "torch_geometric"),
}
for _name in ("pyg-gcn", "pyg-gat", "pyg-gatv2", "pyg-gcn-default", "pyg-gat-default", "pyg-gatv2-default",
              "pyg-sage", "pyg-gin", "pyg-transformer"):
    CORPUS[_name].makers = {"edge_index": edges}
for _name, _entry in CORPUS.items():
    if _entry.requires == "transformers":
        _entry.makers = {"input_ids": tokens, "decoder_input_ids": tokens, "attention_mask": ones}
