"""The gated delta rule over one step's rows: the PyTorch reference (CPU, the HF-exact oracle) and the wrapper
around flash-linear-attention's Triton kernel (CUDA, the optional `ladle[fla]` extra).

For token t of a request, with S its recurrent state [value heads, key dim, value dim] (fp32):
S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t, with q and k l2-normed and q scaled
by key_dim^-0.5. A prefill chunk runs the chunked form of that recurrence (the WY/UT transform inside blocks of
64, the state passed between them) from the request's stored state unless the chunk is its first; a decode row
runs one recurrent step. The maths follows the flash-linear-attention reference that HF transformers mirrors.

Both drivers take q, k [T, key heads, Dk] as projected (not normed, not repeated: value head j reads key head
j // (value heads / key heads), as HF's repeat_interleave does), v [T, value heads, Dv], g (log decay) and
beta [T, value heads]; they read and write the states rec_state[slot] in place and return o [T, value heads,
Dv] in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.attention.metadata import StateMetadata

RULE_CHUNK = 64  # the chunked rule's block: intra-chunk work is quadratic in it, the scan linear in blocks


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk. q, k [L, H, Dk] (already l2-normed, q scaled), v [L, H, Dv], g, beta [L, H], all
    fp32; state [H, Dk, Dv] fp32. Returns (o [L, H, Dv], the state after the chunk)."""
    length = q.shape[0]
    pad = (RULE_CHUNK - length % RULE_CHUNK) % RULE_CHUNK
    # [H, blocks, C, D]: heads first, the sequence cut into blocks of C.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, RULE_CHUNK, x.shape[2])
               for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, RULE_CHUNK) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(RULE_CHUNK, RULE_CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)  # log of the decay from a block's start to each position
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # Solve (I + strictly-lower(beta K K^T * decay)) W = [V beta, K beta exp(cum)]: the UT transform that folds
    # the block's sequential delta updates into matmuls.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                              unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_decayed[:, i] @ state  # what the old state does not already predict
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv],
    all fp32. Returns (o [B, H, Dv], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def torch_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           rec_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The reference over every request's rows: continuing one-token rows in one batched recurrent step, the
    others (prefill chunks) one request at a time in the chunked form."""
    repeat = v.shape[1] // q.shape[1]
    q, k = (x.float().repeat_interleave(repeat, dim=1) for x in (q, k))
    q, k, v = l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v.float()
    cu = meta.cu_seqlens_host
    single = meta.decodes()
    out = torch.empty_like(v)
    if single:
        rows = torch.tensor([cu[i] for i in single], device=q.device)
        slots = meta.slots[single] if len(single) < meta.num_seqs else meta.slots
        o, new = recurrent_gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], rec_state[slots])
        out[rows] = o
        rec_state[slots] = new
    drafting = meta.drafting()
    for i in drafting:  # a decode token and its drafts, one recurrent step each, each state kept for a rollback
        assert meta.draft_rows is not None  # drafting() lists requests only where draft_rows is set
        slot, keep = meta.slots_host[i], meta.draft_rows[i]
        state = rec_state[slot][None]
        for j, r in enumerate(range(cu[i], cu[i + 1])):
            o, state = recurrent_gated_delta_step(q[r : r + 1], k[r : r + 1], v[r : r + 1], g[r : r + 1],
                                                  beta[r : r + 1], state)
            out[r] = o[0]
            if j < len(keep):
                rec_state[keep[j]] = state[0]
        rec_state[slot] = state[0]
    done = set(single) | set(drafting)
    for i, slot in enumerate(meta.slots_host):
        if i in done:
            continue
        lo, hi = cu[i], cu[i + 1]
        start = rec_state[slot] if meta.has_initial_state[i] else rec_state.new_zeros(rec_state.shape[1:])
        out[lo:hi], rec_state[slot] = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                             beta[lo:hi], start)
    return out


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         rec_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """flash-linear-attention's chunked kernel over the whole step as one varlen batch (a decode row is a
    sequence of one): l2 norms and grouped value heads inside the kernel, states gathered from their slots,
    zeroed for first chunks, and scattered back."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    if meta.drafting():
        raise NotImplementedError("drafts on Gated DeltaNet layers need the state after each draft, which this "
                                  "kernel does not return (startup refuses speculative_config on CUDA)")
    initial = rec_state[meta.slots]
    fresh = [i for i, has in enumerate(meta.has_initial_state) if not has]
    if fresh:
        initial[fresh] = 0
    out, final = fla_chunk(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                           initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           cu_seqlens=meta.cu_seqlens, cu_seqlens_cpu=meta.cu_seqlens_cpu)
    rec_state[meta.slots] = final.to(rec_state.dtype)
    return out[0].float()
