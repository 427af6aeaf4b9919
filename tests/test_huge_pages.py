"""CPU weights move into memory advised for transparent huge pages, values and ties unchanged."""
from __future__ import annotations

import torch
from torch import nn

from ladle import LLM
from ladle.models.loading.huge_pages import move_weights_to_huge_pages


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may be backed by huge pages (/proc/self/smaps' THPeligible)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


def test_parameters_move_keeping_their_values_identity_and_ties():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 300, bias=True))
    model[1].weight = model[0].weight  # tied, as a head tied to its embedding
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    moved = move_weights_to_huge_pages(model)
    assert moved >= sum(p.nbytes for p in params)  # each parameter once, the tied one too
    assert list(model.parameters()) == params  # the same Parameter objects
    assert model[1].weight is model[0].weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and _thp_eligible(p.data_ptr())
    x = torch.randint(0, 300, (5,))
    assert torch.equal(model(x), nn.functional.linear(before["0.weight"][x], before["0.weight"], before["1.bias"]))


def test_a_loaded_cpu_model_reads_its_weights_from_huge_pages(tiny_qwen3_dir):
    model = LLM(tiny_qwen3_dir).engine.core.model_executor.runner.model
    weights = [p for p in model.parameters() if p.numel() > 1000]
    assert weights and all(_thp_eligible(p.data_ptr()) for p in weights)
