"""The study harness: sweeps of runs, the paper's tables and figures, and the variance probe.

The top layer: it drives and reads whole runs, and nothing in a run imports it.

May import: agent, estimators, io, learner, models, multihost, parallel, rollout, run, sampler,
tokenizer.

Modules:
  - `sweep`: the sweep command (algorithms x seeds x ablations, resumable) and its flow, with
    `sweep_plan` (the sweep file's `Sweep` and the runs it expands to), `sweep_run` (running them
    as subprocesses, N at a time, Ctrl-C, resume) and `sweep_commit` (sweep.json, finished runs,
    committed records, a finished one never overwritten);
  - `records`: reading run folders;
  - `stats`: bootstrap CIs, IQM, paired comparisons;
  - `tables`: the command that writes the paper's tables (table1.json, table2.json, results.md),
    with `tables_build` (reading run records into Tables 1 and 2) and `figures` (the PNGs);
  - `table2a`: the paper's per-decision variance claim (sibling against trajectory baseline,
    f per branch depth) measured on recorded trees, with bootstrap CIs over tasks;
  - `fshare`: the command that prints a run's f per depth (and Table 2a) from its records, and
    the same tables per algorithm for `tables`;
  - `probe`: the gradient variance of each estimator at matched spend (its flow and command),
    with `probe_sample` (playing the batches, each task's gradient, `ProbeStore`) and
    `probe_stats` (trace variance, ratios, CIs, the report).
"""
