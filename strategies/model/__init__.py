"""The workload every topology is compared on: the models and the data.

    models.py      MLP, a small GPT, and the GPT with mixture-of-experts MLPs
    moe.py         the MoE layer: top-1/top-2 gating, expert capacity per group, balance loss
    data.py        synthetic teacher / Markov data, user .npz / text, global-batch sharding

Knows nothing of distribution: the parallelisms (parallel/) cut these models up.
"""
