"""The study harness: sweeps of runs, the paper's tables and figures, and the variance probe.

The top layer: it drives and reads whole runs, and nothing in a run imports it.

May import: agent, estimators, io, learner, models, multihost, parallel, rollout, run, sampler,
tokenizer.

Modules: `sweep` (algorithms x seeds x ablations, resumable), `records` (reading run folders),
`stats` (bootstrap CIs, IQM, paired comparisons), `tables` and `figures` (the paper's tables),
`probe` (gradient variance of each estimator at matched spend).
"""
