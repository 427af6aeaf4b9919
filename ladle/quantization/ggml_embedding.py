"""A token embedding whose table stays in a GGUF file's block format in memory, and the tied head that reads the
same bytes.

SmolLM2's Q8_0 embedding is a fifth of its parameters: widened to fp32 it was 108 MiB of its 171 MiB of weights,
and as a tied head it was the largest tensor a decode step streams. Kept as the file's blocks it takes 1.0625
bytes a weight. A lookup widens only the rows of the step's tokens (exactly gguf's dequantize values, so the
hidden states are those of a model widened at load); the tied head is a GgmlLinear over the same Parameter, so
decode's logits rows go through the block kernel and nothing is stored twice.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.quantization.fp8_linear import WidenBuffer
from ladle.quantization.ggml_linear import BLOCK_TYPES, GgmlLinear, block_weights, row_bytes, torch_dequantize
from ladle.quantization.layer_interfaces import KeepsDtypes

if TYPE_CHECKING:
    from ladle.kernels.cpu_kernels import CpuKernels


class GgmlEmbedding(nn.Module, KeepsDtypes):
    keep_dtypes = ("weight",)  # the loader's cast to the model dtype leaves the block bytes alone

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str) -> None:
        super().__init__()
        if qtype not in BLOCK_TYPES or embedding_dim % block_weights(qtype):
            raise ValueError(f"GgmlEmbedding takes rows of whole {', '.join(BLOCK_TYPES)} blocks, got {qtype} rows "
                             f"of {embedding_dim}")
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(embedding_dim, qtype), dtype=torch.uint8),
                                   requires_grad=False)
        self.dtype = torch.float32  # what lookups widen into: the model dtype, given by use_ggml_embedding
        self.kernels: CpuKernels | None = None  # set by use_cpu_kernels

    def use_cpu_kernels(self, kernels: CpuKernels, native_bf16: bool, buffer: WidenBuffer | None = None) -> None:
        self.kernels = kernels

    def as_head(self) -> GgmlLinear:
        """The tied head: a GgmlLinear whose weight is this table's Parameter (nothing copied). Built after
        loading, so the checkpoint name stays the embedding's."""
        with torch.device("meta"):  # its own weight would be a second table, replaced at once
            head = GgmlLinear(self.embedding_dim, self.num_embeddings, False, self.qtype)
        head.weight = self.weight
        return head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.weight.index_select(0, flat)  # [T, row bytes]: the step's rows only
        if self.kernels is None or self.dtype not in (torch.float32, torch.bfloat16):
            out = torch_dequantize(rows, self.qtype, self.dtype)
        else:
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
            self.kernels.ggml_dequantize(rows.data_ptr(), out.data_ptr(), flat.numel(), self.embedding_dim,
                                         BLOCK_TYPES[self.qtype][0], int(self.dtype == torch.bfloat16), 1)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, row_bytes=" \
               f"{row_bytes(self.embedding_dim, self.qtype)}"


def use_ggml_embedding(root: nn.Module, types: dict[str, str], dtype: torch.dtype) -> set[str]:
    """Replace root.model.embed_tokens (on meta) by a GgmlEmbedding where its checkpoint weight is in a block
    type of BLOCK_TYPES (types: HF weight name -> ggml type name); returns the checkpoint names now kept as
    blocks (the loader reads those raw). dtype: the model's, which lookups widen into."""
    qtype = types.get("model.embed_tokens.weight")
    try:
        model = root.get_submodule("model")
        embed = model.get_submodule("embed_tokens")
    except AttributeError:  # a model whose table lies elsewhere keeps it widened
        return set()
    if not isinstance(embed, nn.Embedding) or qtype not in BLOCK_TYPES:
        return set()
    try:
        kept = GgmlEmbedding(embed.num_embeddings, embed.embedding_dim, qtype)
    except ValueError:  # rows not whole blocks: widened, as a linear of that shape would be
        return set()
    kept.dtype = dtype
    model.embed_tokens = kept
    return {"model.embed_tokens.weight"}
