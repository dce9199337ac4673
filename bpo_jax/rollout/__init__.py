"""The rollout engine: episodes played as forests of independent groups or BPO trees.

Where a tree branches (the planner and its rules), how its forest is built, and how it is played.

May import: agent, estimators, sampler.

Modules: `engine` (`play`, `play_forest`, `TreeSpec`), `loop` (the lockstep loop: every
sandbox of a batch advances one turn per sampling call), `planner` (which live paths branch at a
turn), `branching` (branch rules, thresholds, the budget), `forest` and `forest_builder` (the
segments and their conversion to the estimator's arrays), `cohorts` (groups of tasks whose turns
are pipelined), `posthoc` (the post-hoc top-k ablation), `timing` (where an iteration's seconds
go), `design` (the first-order variance model of a tree's shape and the choice of one),
`design_stats` (what earlier batches measured for it: `rollout.tree=auto`), `explained` (f, the
share of the return variance the branch points explain, measured every batch; `bpo_shrink`'s
lam from earlier batches) and `concentration` (how concentrated a batch's branch points are).
"""
