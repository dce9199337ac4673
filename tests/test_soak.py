"""Fault soak of the sandbox pool (envs.sandbox.soak): episodes through the fork pool while
workers are killed, hung and write garbage, and the zygote is killed.

Every episode started ends, finished or truncated with a reason; none is lost; the faults the
pool reports are the ones injected, kind for kind; no process is left and no child unreaped.
"""

import pytest

from envs.sandbox.soak import SoakConfig, SoakReport, run_soak


def _check(report: SoakReport) -> None:
    assert report.lost == 0, report
    assert report.episodes_started == report.episodes_finished + report.episodes_truncated
    assert report.processes_left == 0, report.left
    assert report.unreaped_children == 0, report
    assert report.faults_seen == report.faults_injected, report
    faults = sum(report.faults_injected.values())
    assert sum(report.truncated_by_reason.values()) == report.episodes_truncated
    assert report.episodes_truncated == faults + report.truncated_by_reason["step limit"]
    assert report.ok()


def test_short_soak_at_high_fault_rates():
    config = SoakConfig(waves=2, tasks_per_wave=6, kill_rate=0.05, hang_rate=0.03,
                        garbage_rate=0.05, zygote_kill_rate=1.0, seed=1)  # fmt: skip
    report = run_soak(config)
    _check(report)
    assert report.zygote_kills == 2 and report.episodes_started >= 12


@pytest.mark.slow
def test_fault_soak_a_few_hundred_episodes():
    report = run_soak(SoakConfig(waves=10, tasks_per_wave=16, seed=0))
    _check(report)
    assert report.episodes_started >= 300, report
    assert set(report.faults_injected) == {"crash", "timeout", "garbage"}, report
    assert report.zygote_kills >= 2 and report.episodes_finished >= 100, report
    assert report.wall_s < 180, report
