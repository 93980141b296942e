"""Mixture of experts: E feed-forward experts per block, each token routed to k of them.

    moe = MoE(d_model=64, experts=4, top_k=2, capacity_factor=1.25, group_size=0,
              balance_coef=0.01)
    y = moe(x)              # x, y: (batch, seq, d_model); the block adds y to its residual
    moe.balance_loss        # this forward's load-balancing loss, already times its coefficient
    moe.dropped_fraction    # the share of its token choices over capacity, dropped

Papers:
  Shazeer, Mirhoseini, Maziarz, Davis, Le, Hinton & Dean, "Outrageously Large Neural
  Networks: The Sparsely-Gated Mixture-of-Experts Layer", ICLR 2017: a trainable gate
  picks k of E experts per token, so parameters grow with E while flops per token stay.
  Lepikhin, Lee, Xu, Chen, Firat, Huang, Krikun, Shazeer & Chen, "GShard: Scaling Giant
  Models with Conditional Computation and Automatic Sharding", ICLR 2021: top-2 gating,
  an expert *capacity* per *group* of tokens (fixed shapes: an expert's buffer holds C
  tokens, the rest are dropped), the dispatch and combine einsums below, experts
  spread over devices by all-to-alls (expert_parallel.py).
  Fedus, Zoph & Shazeer, "Switch Transformers: Scaling to Trillion Parameter Models
  with Simple and Efficient Sparsity", JMLR 2022: top-1 routing, capacity factor, and
  the load-balancing loss  alpha * E * sum_e f_e * P_e  (their eq. 4).

The layer, GShard's Algorithm 1 as einsums (G groups of S tokens, E experts, capacity C):

  1. group     x (B, T, d) -> (G, S, d): a group is `group_size` sequences
               (0: the whole batch this forward sees); capacity and dropping are
               decided per group.  The trainer writes its default in: one forward
               call's sequences, a data-parallel rank's local batch, or one of its
               micro-batches (config/validate.py's gating_group)
  2. gate      probs = softmax(x Wg)                                  (G, S, E)
  3. top-k     first choice e1 = argmax probs; top-2: e2 = argmax of the others
  4. capacity  C = ceil(capacity_factor * k * S / E), at most S.  A token's position in
               its expert's buffer is the number of tokens of its group that chose that
               expert before it, every first choice before every second choice; a choice
               at position >= C is dropped
  5. dispatch  expert_in[e, g, c] = x[g, s], s the token at position c of expert e
               (E, G, C, d); empty positions are zeros
  6. experts   expert_out[e] = FFN_e(expert_in[e])                    (E, G, C, d)
               (expert_parallel.py puts an all-to-all before and after this line)
  7. combine   y[g, s] = sum over s's kept choices e of gate_e * expert_out[e, g, c]

One group of S = 6 tokens, E = 3 experts, top-1, C = 2:

    token        t0  t1  t2  t3  t4  t5
    expert        0   2   0   0   1   2
    position      0   0   1   2   0   1
    kept          y   y   y   n   y   y     t3: expert 0 is full, so y[t3] = 0 and
                                            t3 goes on through the block's residual

Gates: top-1 scales the expert's output by its probability p_e1 (Switch), so the gate
gets a gradient; top-2 by p_e1 / (p_e1 + p_e2) and p_e2 / (p_e1 + p_e2) (GShard),
normalised before dropping.  No noise (Shazeer's noisy top-k) and no random second
expert (GShard's): a step is a deterministic function of parameters and batch, so
P ranks reproduce one process.

Load balance (Switch, eq. 4), per group and averaged over the groups:
    balance = E * sum_e f_e * P_e,   f_e = share of the group's tokens whose first
    choice is e (before dropping), P_e = mean of probs[:, e] over the group.
It is 1 for a uniform router; the criterion adds balance_coef * balance to the loss.
A rank's loss holds the mean over its own groups and the ranks' gradients are
averaged, which is the mean over all groups: data parallelism stays exact with it.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def expert_capacity(tokens, experts, top_k, capacity_factor):
    """C: how many tokens of a group of `tokens` each expert's buffer holds."""
    return max(1, min(tokens, math.ceil(capacity_factor * top_k * tokens / experts)))


def route(logits, top_k, capacity):
    """GShard's gating for logits (G, S, E): (dispatch, combine, balance).

    dispatch (G, S, E, C) is 1 where token s sits at position c of expert e, combine
    the same with the gate's weight; balance is Switch's loss, averaged over groups."""
    G, S, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    # 3. top-k: the best expert, then the best of the others
    choices, taken = [], torch.zeros_like(probs, dtype=torch.bool)
    for _ in range(top_k):
        expert = probs.detach().masked_fill(taken, -1.0).argmax(dim=-1)      # (G, S)
        mask = F.one_hot(expert, E).to(probs.dtype)                          # (G, S, E)
        taken = taken | mask.bool()
        choices.append([mask, (probs * mask).sum(dim=-1)])                   # gate (G, S)
    if top_k == 2:                 # GShard: the two gates normalised to sum to one
        total = choices[0][1] + choices[1][1]
        for choice in choices:
            choice[1] = choice[1] / total
    # 4. capacity: positions in the experts' buffers, first choices first
    dispatch = torch.zeros(G, S, E, capacity, dtype=probs.dtype, device=probs.device)
    combine = torch.zeros_like(dispatch)
    filled = torch.zeros(G, 1, E, dtype=probs.dtype, device=probs.device)
    for mask, gate in choices:
        position = torch.cumsum(mask, dim=1) - 1 + filled                    # (G, S, E)
        kept = mask * (position < capacity)
        filled = filled + kept.sum(dim=1, keepdim=True)
        slot = F.one_hot((position * kept).sum(dim=-1).long(), capacity)     # (G, S, C)
        placed = kept.unsqueeze(-1) * slot.unsqueeze(2).to(probs.dtype)      # (G, S, E, C)
        dispatch = dispatch + placed
        combine = combine + gate[..., None, None] * placed
    # Switch's load-balancing loss, from the first choices before dropping
    share = choices[0][0].mean(dim=1)                                        # f (G, E)
    balance = E * (share * probs.mean(dim=1)).sum(dim=-1).mean()
    return dispatch, combine, balance


def run_experts(experts, expert_in):
    """6. every expert of `experts` (a ModuleDict, in order) on its slice of expert_in
    (E, ..., d): the whole step on one process, a rank's own experts between
    expert_parallel.py's all-to-alls."""
    return torch.stack([expert(expert_in[i]) for i, expert in enumerate(experts.values())])


class MoE(nn.Module):
    """The block's MLP as a mixture of experts (the module docstring's steps 1-7).

    experts is a ModuleDict keyed by the global expert index ("0" .. "E-1"), so that
    parameter names (blocks.0.mlp.experts.2.0.weight) stay the same when expert
    parallelism keeps only some of them on a rank.  `exchange(experts, expert_in)`
    runs step 6: run_experts here, two all-to-alls around it in expert_parallel.py."""

    def __init__(self, d_model, experts, top_k, capacity_factor, group_size, balance_coef):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.capacity_factor, self.group_size = capacity_factor, group_size
        self.balance_coef = balance_coef
        self.gate = nn.Linear(d_model, experts, bias=False)
        # each expert is the GPT's own 4x GELU MLP
        self.experts = nn.ModuleDict({str(e): nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            for e in range(experts)})
        self.exchange = run_experts
        self.balance_loss = self.dropped_fraction = 0.0

    def forward(self, x):
        B, T, d = x.shape
        # 1. group: group_size sequences, or the whole batch of this call
        per_group = self.group_size or B
        groups = x.reshape(B // per_group, per_group * T, d)                 # (G, S, d)
        capacity = expert_capacity(per_group * T, self.num_experts, self.top_k,
                                   self.capacity_factor)
        # 2.-4. gate, top-k, capacity
        dispatch, combine, balance = route(self.gate(groups), self.top_k, capacity)
        self.balance_loss = self.balance_coef * balance
        # the share of the k choices of every token that found its expert full
        self.dropped_fraction = 1.0 - dispatch.sum().item() / (groups.shape[0] *
                                                              groups.shape[1] * self.top_k)
        # 5. dispatch, 6. experts, 7. combine
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, groups)
        expert_out = self.exchange(self.experts, expert_in)
        return torch.einsum("gsec,egcd->gsd", combine, expert_out).reshape(B, T, d)

    def extra_repr(self):
        return f"experts={self.num_experts}, top_k={self.top_k}, " \
               f"capacity_factor={self.capacity_factor}, group_size={self.group_size}"
