"""The pure builders of per-step metadata, for mixed steps with prefix offsets."""
import pytest
import torch

from ladle.runner import step_layout
from ladle.runner.inputs import build_step_inputs
from ladle.runner.step_batch import StepBatch


def test_mixed_step_metadata():
    bs = 4
    step = (StepBatch()
            .add(token_ids=[11, 12, 13], start_pos=5, block_ids=[7, 2], sample=False)  # chunk at offset 5
            .add(token_ids=[21], start_pos=9, block_ids=[0, 3, 9], sample=True)  # a decode
            .add(token_ids=[31, 32], start_pos=0, block_ids=[5], sample=True))  # a new prompt's last chunk
    inp = build_step_inputs(step, bs)
    assert inp.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert inp.positions.tolist() == [5, 6, 7, 9, 0, 1]
    # pos 5,6,7 -> block index 1 (id 2) offsets 1,2,3; pos 9 -> block index 2 (id 9) offset 1; pos 0,1 -> id 5
    assert inp.attn.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1]
    assert inp.attn.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert inp.attn.context_lens.tolist() == [8, 10, 2]
    assert inp.attn.query_lens == (3, 1, 2)
    assert inp.attn.block_tables.tolist() == [[7, 2, 0], [0, 3, 9], [5, 0, 0]]
    assert inp.attn.block_tables.dtype == torch.int32
    assert inp.logits_indices.tolist() == [3, 5]  # last row of each sampled chunk
    assert inp.sampled_rows == (1, 2)


def test_chunk_boundary_on_block_edge():
    step = StepBatch().add(token_ids=[1] * 4, start_pos=4, block_ids=[3, 1, 8], sample=False)
    inp = build_step_inputs(step, 4)
    assert inp.attn.slot_mapping.tolist() == [4, 5, 6, 7]
    assert inp.attn.block_tables.tolist() == [[3, 1]]  # only blocks holding context after the step
    assert inp.logits_indices.tolist() == []


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_step_inputs(StepBatch().add([1, 2, 3], start_pos=3, block_ids=[0], sample=True), 4)
    with pytest.raises(ValueError):
        build_step_inputs(StepBatch(), 4)


def test_decode_steps_lay_out_alike_in_lists_and_in_arrays(monkeypatch):
    """Decode-only steps up to DECODE_LISTS_MAX requests are laid out in Python lists, larger ones (and all
    with a chunk) in numpy: both give the same inputs, with and without a kept table."""
    step = StepBatch()
    for i, p in enumerate([0, 3, 4, 9, 15, 16]):
        step.add([10 + i], p, [(7 * i + b) % 50 for b in range(p // 4 + 1)], i != 2)
    tables = (torch.tensor([t[0] + [0] * (5 - len(t[0])) for t in step.block_ids], dtype=torch.int32),)
    for kept in (None, tables):
        lists = build_step_inputs(step, 4, block_tables=kept)
        monkeypatch.setattr(step_layout, "DECODE_LISTS_MAX", 0)
        arrays = build_step_inputs(step, 4, block_tables=kept)
        monkeypatch.undo()
        for a, b in ((lists, arrays), (lists.attn, arrays.attn)):
            for name in ("input_ids", "positions", "logits_indices", "slot_mapping", "cu_seqlens_q",
                         "context_lens", "block_tables"):
                if hasattr(a, name):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert lists.sampled_rows == arrays.sampled_rows == (0, 1, 3, 4, 5)
        assert lists.attn.context_lens_host == arrays.attn.context_lens_host == (1, 4, 5, 10, 16, 17)
        assert lists.attn.slot_mapping.tolist()[3] == step.block_ids[3][0][2] * 4 + 1
    with pytest.raises(ValueError, match="needs 3 blocks"):
        build_step_inputs(StepBatch().add([1], start_pos=8, block_ids=[0, 1], sample=True), 4)


def _layout(step, bs=4):
    return step_layout.lay_out(step, bs, ((1, 1),), None)


def test_padded_decodes_write_and_read_nothing():
    """What a decode graph of 4 rows gets for 2 decodes: padding rows of token 0 at position 0 with slot -1 (no
    KV write), context 0 (no KV read) and zero table rows; the real rows are the eager layout's."""
    real = _layout(StepBatch().add([5], 6, [3, 8], True).add([6], 0, [2], True))
    padded = step_layout.pad_decodes(real, 4)
    assert list(padded.token_ids) == [5, 6, 0, 0] and list(padded.positions) == [6, 0, 0, 0]
    assert list(padded.slots[0]) == [8 * 4 + 2, 2 * 4, -1, -1]
    assert list(padded.cu) == [0, 1, 2, 3, 4] and list(padded.context) == [7, 1, 0, 0]
    assert padded.query_lens == (1, 1, 1, 1)
    assert padded.tables[0].tolist() == [[3, 8], [2, 0], [0, 0], [0, 0]]
    assert list(padded.logits_indices) == [0, 1] and padded.sampled_rows == (0, 1)


def test_padded_tokens_form_one_request_that_writes_nothing():
    """What a mixed graph of 16 tokens and 6 request rows gets for a 3-token chunk beside a decode: one more
    request of the 12 padding tokens (slots -1, positions 0.., context 12, table of block 0), then requests
    with no tokens; the sampled rows stay the real ones."""
    real = _layout(StepBatch().add([1, 2, 3], 2, [4, 9], True).add([7], 5, [6, 1], True))
    padded = step_layout.pad_tokens(real, 16, 6, 4)
    assert list(padded.cu) == [0, 3, 4, 16, 16, 16, 16]
    assert padded.query_lens == (3, 1, 12, 0, 0, 0)
    assert list(padded.context) == [5, 6, 12, 0, 0, 0]
    assert list(padded.positions) == [2, 3, 4, 5] + list(range(12))
    assert list(padded.slots[0]) == [4 * 4 + 2, 4 * 4 + 3, 9 * 4, 1 * 4 + 1] + [-1] * 12
    assert padded.tables[0].shape == (6, 3) and padded.tables[0][2:].sum() == 0  # the padding reads block 0
    assert list(padded.logits_indices) == [2, 3] and padded.sampled_rows == (0, 1)
    with pytest.raises(ValueError, match="padded step cannot carry state"):
        from ladle.attention.groups import reference_group
        from ladle.runner.inputs import fill_inputs
        from ladle.runner.step_buffers import StepBuffers

        fill_inputs(padded, StepBuffers(torch.device("cpu")), 4, (reference_group(),), num_state_groups=1)
