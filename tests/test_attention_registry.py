"""The attention backends by name: the CLI offers exactly the registered ones, each declares truthfully where
it runs and what it serves, the metadata it builds names it, and the sink-attention capability is declared only
by the backends that implement it. The selector's choices on CPU are in tests/test_cpu_attention.py."""
from __future__ import annotations

import pytest
import torch

from ladle.attention.backend import AttentionBackend, CacheKind
from ladle.attention.cpu_attention import CpuAttentionMetadata
from ladle.attention.metadata import CommonAttentionMetadata
from ladle.attention.registry import BACKENDS, backend_class
from ladle.attention.selector import resolve_backend, select_backend
from ladle.attention.sink_capability import SupportsSinkAttention
from ladle.attention.torch_backend import TorchAttention, TorchAttentionMetadata
from ladle.attention.triton_backend import TritonAttention, TritonAttentionMetadata
from ladle.config.engine_args import ATTENTION_BACKENDS
from ladle.kv_cache.specs import AttentionSpec

CUDA = torch.device("cuda")  # only declarations are read: no GPU needed
SHARED = AttentionSpec(1, 64, torch.float32, 128, kv_shared=True)


def test_the_cli_offers_exactly_the_registered_backends():
    assert sorted(BACKENDS) == sorted(ATTENTION_BACKENDS)
    assert all(name == cls.name for name, cls in BACKENDS.items())
    with pytest.raises(ValueError, match="choose one of"):
        backend_class("flash")


def test_triton_declares_cuda_its_dtypes_and_every_cache_kind():
    assert TritonAttention.devices == {"cuda"}
    assert TritonAttention.dtypes == {torch.float32, torch.bfloat16, torch.float16}
    for spec in (AttentionSpec(4, 64, torch.bfloat16), AttentionSpec(4, 64, torch.float16, 32), SHARED,
                 AttentionSpec(1, 64, torch.float32, None, kv_shared=True, compress_rate=4)):
        assert TritonAttention.supports(spec, CUDA)
    assert TritonAttention.lacks(AttentionSpec(4, 64, torch.bfloat16), torch.device("cpu")) == [
        "CPU (it runs on CUDA)"]
    assert TritonAttention.lacks(AttentionSpec(4, 64, torch.float8_e4m3fn), CUDA) == ["float8_e4m3fn caches"]


def test_sink_attention_is_declared_by_exactly_the_backends_that_serve_shared_kv():
    assert not issubclass(AttentionBackend, SupportsSinkAttention)
    for cls in BACKENDS.values():
        assert issubclass(cls, SupportsSinkAttention) == (CacheKind.SHARED_KV in cls.kinds), cls.name
    assert {cls.name for cls in BACKENDS.values() if issubclass(cls, SupportsSinkAttention)} == {"torch", "triton"}
    assert BACKENDS["cpu"].lacks(SHARED, torch.device("cpu")) == [CacheKind.SHARED_KV.value]


def test_each_backend_builds_metadata_of_its_own_type_naming_it():
    common = CommonAttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                     (1,), (1,), 16)
    slots, tables = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32)
    for backend, cls in ((TorchAttention(), TorchAttentionMetadata), (TritonAttention(), TritonAttentionMetadata)):
        meta = backend.build_metadata(common, slots, tables, 8)
        assert type(meta) is cls and meta.backend is backend and meta.sliding_window == 8
    from ladle.kernels.cpu_kernels import KernelUnavailable

    try:
        cpu = BACKENDS["cpu"].create()
    except KernelUnavailable:
        pytest.skip("no C compiler here")
    assert type(cpu.build_metadata(common, slots, tables, None)) is CpuAttentionMetadata


def test_a_named_backend_that_lacks_what_a_group_needs_fails_naming_it():
    fp8 = AttentionSpec(4, 64, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"attention_backend=.triton. cannot serve .* it lacks float8_e4m3fn caches"):
        select_backend(CUDA, fp8, "triton")
    with pytest.raises(ValueError, match="needs CPU; on CUDA use triton"):
        resolve_backend(CUDA, "torch")
    assert resolve_backend(CUDA, None) == ("triton", TritonAttention.description)
    assert isinstance(select_backend(CUDA, SHARED, "triton"), TritonAttention)
    assert isinstance(select_backend(torch.device("cpu"), SHARED, "torch"), TorchAttention)


def test_deepseek_v4_refuses_a_backend_without_sink_attention():
    from ladle.kernels.cpu_kernels import KernelUnavailable
    from ladle.models.deepseek_v4.attention import sink_backend

    common = CommonAttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                     (1,), (1,), 16)
    slots, tables = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32)
    torch_backend = TorchAttention()
    assert sink_backend(torch_backend.build_metadata(common, slots, tables, 8)) is torch_backend
    try:
        cpu = BACKENDS["cpu"].create()
    except KernelUnavailable:
        pytest.skip("no C compiler here")
    with pytest.raises(TypeError, match=r"needs a backend that runs sink attention.*'cpu' backend does not"):
        sink_backend(cpu.build_metadata(common, slots, tables, 8))
