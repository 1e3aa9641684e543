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
    flagged: bool = False  # fxmem cannot know its numbers (a kernel's hidden scratch): its report must say so

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


class TokensAsImage(nn.Module):
    """timm CoaT / PVT / CvT's positional conv: patch tokens made an image again for a depthwise
    conv (at batch 1 that view is contiguous for ATen, channels-last for fake tensors)."""

    def __init__(self, c: int = 64):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 4, stride=4)
        self.norm = nn.LayerNorm(c)
        self.pos = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.mlp = nn.Linear(c, c)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.embed(img)
        B, C, H, W = x.shape
        tokens = self.norm(x.flatten(2).transpose(1, 2))
        tokens = tokens + self.pos(tokens.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2)
        return self.mlp(tokens)


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


class SpatialReductionAttention(nn.Module):
    """PVT-v2 / SegFormer's attention: queries from every patch token, keys and values from the
    image reduced by a strided conv (with a symbolic image size the probe's every-dim-1 sizes once
    gave keys of length 0 to SDPA's CPU kernel, which killed the process)."""

    def __init__(self, c: int = 32, heads: int = 2, reduction: int = 2):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 4, stride=4)
        self.q = nn.Linear(c, c)
        self.sr = nn.Conv2d(c, c, reduction, stride=reduction)
        self.norm = nn.LayerNorm(c)
        self.kv = nn.Linear(c, 2 * c)
        self.proj = nn.Linear(c, c)
        self.heads = heads

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.embed(img)
        B, C, H, W = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        q = self.q(tokens).reshape(B, -1, self.heads, C // self.heads).transpose(1, 2)
        reduced = self.norm(self.sr(x).flatten(2).transpose(1, 2))
        k, v = self.kv(reduced).reshape(B, -1, 2, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, -1, C))


class UNetAttentionBlock(nn.Module):
    """A diffusers UNet's attention block: GroupNorm, the image made tokens, attention, tokens made
    an image again (at batch 1 ATen lays that view out as neither NCHW nor channels-last), a residual
    and a rescale, then GroupNorm, SiLU and a conv that pick their path by that layout."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.norm = nn.GroupNorm(c // 4, c)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)
        self.norm2 = nn.GroupNorm(c // 4, c)
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.norm(x).view(B, C, H * W).transpose(1, 2)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v))
        h = (h.transpose(-1, -2).reshape(B, C, H, W) + x) / 1.0
        return self.conv(torch.nn.functional.silu(self.norm2(h)))


class DiffusersUNet(nn.Module):
    """diffusers' UNet2DModel (a tiny config with an attention level), called with a timestep."""

    def __init__(self):
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                block_out_channels=(16, 32), norm_num_groups=8,
                                down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                up_block_types=("AttnUpBlock2D", "UpBlock2D"))

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep).sample


@torch.library.custom_op("fxmem_corpus::scaled_with_workspace", mutates_args=())
def scaled_with_workspace(x: torch.Tensor) -> torch.Tensor:
    """A user's custom op whose real kernel takes a workspace of twice its input that its fake
    kernel does not show: only a real run sees it, so the report must flag its numbers."""
    work = torch.empty(2 * x.numel(), dtype=x.dtype)
    work.fill_(2.0)
    return x * work[: x.numel()].view_as(x)


@scaled_with_workspace.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


scaled_with_workspace.register_autograd(lambda ctx, grad: grad * 2.0)


class CustomOpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_with_workspace(self.lin(x)).relu()


def timesteps(shape: tuple, dims: dict) -> torch.Tensor:
    return torch.randint(0, 1000, shape)


CORPUS: dict[str, Entry] = {
    "coat-like-pos-conv": Entry(TokensAsImage, (("B", 3, 96, 96),), [dict(B=1), dict(B=3)], "torch"),
    "coat-like-pos-conv-any-size": Entry(TokensAsImage, (("B", 3, "S", "S"),), [dict(B=1, S=16), dict(B=2, S=36)],
                                         "torch"),
    "pvt-like-reduced-keys": Entry(SpatialReductionAttention, (("B", 3, "S", "S"),),
                                   [dict(B=1, S=16), dict(B=2, S=40)], "torch"),
    "unet-attention-block": Entry(UNetAttentionBlock, (("B", 32, "S", "S"),), [dict(B=1, S=6), dict(B=2, S=9)],
                                  "torch"),
    "custom-op-hidden-workspace": Entry(CustomOpBlock, (("B", 16),), [dict(B=1), dict(B=5)], "torch", flagged=True),
    "diffusers-unet": Entry(DiffusersUNet, (("B", 3, "S", "S"), fxmem.TensorSpec(("B",), dtype=torch.int64)),
                            [dict(B=1, S=16), dict(B=2, S=24)], "diffusers", makers={"timestep": timesteps}),
    "convnext-stem": Entry(PatchifyStem, (("B", 3, "S", "S"),), [dict(B=1, S=16), dict(B=2, S=36)], "torch"),
    "mixtral-moe": Entry(_hf("MixtralConfig", "MixtralModel", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=256, **SMALL), (IDS,), SIZES, "transformers"),
    "clip-text": Entry(_hf("CLIPTextConfig", "CLIPTextModel", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77, bos_token_id=0,
                           eos_token_id=1, pad_token_id=1, **SMALL), (IDS,), SIZES, "transformers"),
    "gpt2": Entry(_hf("GPT2Config", "GPT2Model", n_embd=32, n_layer=2, n_head=4, n_positions=256,
                      bos_token_id=0, eos_token_id=0, **SMALL), (IDS,), SIZES, "transformers"),
    # BertModel's pooler runs but the loss reads only the hidden states: its parameters get no
    # gradient, so AdamW makes no state for them (HF's pooler, a class of issue 25)
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


# A second corpus, run by ``benchmarks/exactness.py --corpus held-out``, not by the tests (it would
# double CI's time): 41 more public architectures that no change to fxmem was made for when they were
# first run (2026-12-07), at sizes other than the corpus' (batch 2-5, lengths 5 and 19, graphs of 7 and
# 13 nodes). Decoders, encoders, vision backbones from Hugging Face; PyG layers beyond the corpus'.
_DEC = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
            max_position_embeddings=256, **SMALL)
_ENC = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
            max_position_embeddings=256, **SMALL)
_TOKENS = [dict(B=3, L=5), dict(B=2, L=19)]
_PIXELS, _IMAGES = ((("B", 3, 32, 32)),), [dict(B=2), dict(B=5)]
_GRAPHS = [dict(N=7, E=20), dict(N=13, E=41)]


def _hf_ids(config_cls: str, model_cls: str, **config: Any) -> Entry:
    return Entry(_hf(config_cls, model_cls, **config), (IDS,), _TOKENS, "transformers")


def _hf_pixels(config_cls: str, model_cls: str, **config: Any) -> Entry:
    return Entry(_hf(config_cls, model_cls, ("pixel_values",), **config), _PIXELS, _IMAGES, "transformers")


def _pyg_graph(layer: str, *args: Any, data: Callable[[list], dict] | None = None, **kw: Any) -> Entry:
    return Entry(_pyg(layer, *args, **kw), GRAPH, _GRAPHS, "torch_geometric", data=data)


def _cheb_counts(inputs: list) -> dict:
    """ChebConv's counts: the edges that are not loops (K1), and the loops it then masks (K2: one per node)."""
    return {**edges_kept(inputs), "K2": inputs[0].shape[0]}


HELD_OUT: dict[str, Entry] = {
    "mistral": _hf_ids("MistralConfig", "MistralModel", **_DEC),
    "phi3": _hf_ids("Phi3Config", "Phi3Model", pad_token_id=0, **_DEC),
    "phi": _hf_ids("PhiConfig", "PhiModel", **_DEC),
    "gemma": _hf_ids("GemmaConfig", "GemmaModel", head_dim=8, **_DEC),
    "gemma2": _hf_ids("Gemma2Config", "Gemma2Model", head_dim=8, **_DEC),
    "qwen3": _hf_ids("Qwen3Config", "Qwen3Model", head_dim=8, **_DEC),
    "olmo2": _hf_ids("Olmo2Config", "Olmo2Model", **_DEC),
    "granite": _hf_ids("GraniteConfig", "GraniteModel", **_DEC),
    "cohere": _hf_ids("CohereConfig", "CohereModel", **_DEC),
    "stablelm": _hf_ids("StableLmConfig", "StableLmModel", **_DEC),
    "gpt-neox": _hf_ids("GPTNeoXConfig", "GPTNeoXModel", **_ENC),
    "opt": _hf_ids("OPTConfig", "OPTModel", hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32,
                   num_hidden_layers=2, max_position_embeddings=256, **SMALL),
    "falcon": _hf_ids("FalconConfig", "FalconModel", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                      **SMALL),
    "bloom": _hf_ids("BloomConfig", "BloomModel", hidden_size=32, n_head=4, n_layer=2, **SMALL),
    "gpt-j": _hf_ids("GPTJConfig", "GPTJModel", n_embd=32, n_head=4, n_layer=2, rotary_dim=4, n_positions=256, **SMALL),
    "roberta": _hf_ids("RobertaConfig", "RobertaModel", pad_token_id=1, **_ENC),
    "albert": _hf_ids("AlbertConfig", "AlbertModel", embedding_size=16, **_ENC),
    "electra": _hf_ids("ElectraConfig", "ElectraModel", embedding_size=16, **_ENC),
    "deberta-v2": _hf_ids("DebertaV2Config", "DebertaV2Model", **_ENC),
    "mpnet": _hf_ids("MPNetConfig", "MPNetModel", **_ENC),
    "roformer": _hf_ids("RoFormerConfig", "RoFormerModel", embedding_size=32, **_ENC),
    "mobilebert": _hf_ids("MobileBertConfig", "MobileBertModel", hidden_size=32, embedding_size=16,
                          intermediate_size=64, num_attention_heads=4, true_hidden_size=32, intra_bottleneck_size=32,
                          num_feedforward_networks=2, num_hidden_layers=2, max_position_embeddings=256, **SMALL),
    "swin": _hf_pixels("SwinConfig", "SwinModel", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                       num_heads=[2, 2], window_size=4),
    "convnext": _hf_pixels("ConvNextConfig", "ConvNextModel", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                           image_size=32),
    "resnet": _hf_pixels("ResNetConfig", "ResNetModel", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
    "segformer": _hf_pixels("SegformerConfig", "SegformerModel", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                            hidden_sizes=[8, 16], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                            mlp_ratios=[2, 2], decoder_hidden_size=16),
    "beit": _hf_pixels("BeitConfig", "BeitModel", image_size=32, patch_size=8, hidden_size=32, num_attention_heads=4,
                       intermediate_size=64, num_hidden_layers=2),
    "dinov2": _hf_pixels("Dinov2Config", "Dinov2Model", image_size=32, patch_size=8, hidden_size=32,
                         num_attention_heads=4, mlp_ratio=2, num_hidden_layers=2),
    "mobilevit": _hf_pixels("MobileViTConfig", "MobileViTModel", image_size=32, hidden_sizes=[16, 24, 32],
                            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
    "pyg-graph": _pyg_graph("GraphConv", 16, 32),
    "pyg-cheb": _pyg_graph("ChebConv", 16, 32, K=3, data=_cheb_counts),
    "pyg-tag": _pyg_graph("TAGConv", 16, 32),
    "pyg-sg": _pyg_graph("SGConv", 16, 32, K=2, data=edges_kept),
    "pyg-resgated": _pyg_graph("ResGatedGraphConv", 16, 32),
    "pyg-gatedgraph": _pyg_graph("GatedGraphConv", 16, 2),
    "pyg-le": _pyg_graph("LEConv", 16, 32),
    "pyg-gen": _pyg_graph("GENConv", 16, 32),
    "pyg-general": _pyg_graph("GeneralConv", 16, 32, attention=True),
    "pyg-film": _pyg_graph("FiLMConv", 16, 32),
    "pyg-sage-max": _pyg_graph("SAGEConv", 16, 32, aggr="max"),
    "pyg-gatv2-shared": _pyg_graph("GATv2Conv", 16, 8, heads=2, share_weights=True, add_self_loops=False),
}
for _name, _entry in HELD_OUT.items():
    _entry.makers = ({"input_ids": tokens} if _entry.requires == "transformers" else {"edge_index": edges})
