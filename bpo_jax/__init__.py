"""bpo_jax: Branching Policy Optimization for language agents in snapshottable sandboxes."""
