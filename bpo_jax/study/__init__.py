"""The study harness: sweeps of runs, the paper's tables and figures, and the variance probe.

The top layer: it drives and reads whole runs, and nothing in a run imports it.

May import: agent, estimators, io, learner, models, multihost, parallel, rollout, run, sampler,
tokenizer.

Modules: `sweep` (the sweep command: algorithms x seeds x ablations, resumable), with
`sweep_plan` (the sweep file's `Sweep` and the runs it expands to), `sweep_run` (running them
as subprocesses, N at a time, Ctrl-C, resume) and `sweep_commit` (sweep.json, finished runs,
committed records); `records` (reading run folders),
`stats` (bootstrap CIs, IQM, paired comparisons), `tables` and `figures` (the paper's tables),
`probe` (gradient variance of each estimator at matched spend: the flow and the command), with
`probe_sample` (playing the batches, each task's gradient, `ProbeStore`) and `probe_stats` (trace
variance ratios, CIs, the report).
"""
