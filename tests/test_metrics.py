"""Tests for bpo_jax.io.metrics: JSON-lines and TensorBoard writing, and the progress bar."""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from bpo_jax.io import metrics


def read_tb_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Parses tensorboardX event files (TFRecord framing) into tag -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, payload, payload crc.
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_write_jsonl_and_tensorboard(tmp_path):
    workdir = tmp_path / "run"
    with metrics.MetricWriter(workdir) as writer:
        writer.write(
            1,
            {
                "loss": jnp.float32(0.5),
                "reward/mean": np.float64(0.25),
                "tokens": jnp.array(7, jnp.int32),
                "episodes": 3,
                "lr": 1e-3,
                "solved": np.bool_(True),
            },
        )
        writer.write(jnp.int32(2), {"loss": jnp.array(0.125)})

    records = metrics.read_metrics(workdir)
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert first["loss"] == 0.5 and isinstance(first["loss"], float)
    assert first["tokens"] == 7 and isinstance(first["tokens"], int)
    assert first["solved"] == 1
    assert (first["reward/mean"], first["episodes"], first["lr"]) == (0.25, 3, 1e-3)
    assert records[1]["loss"] == 0.125
    assert records[0]["time"] <= records[1]["time"]

    scalars = read_tb_scalars(workdir / "tb")
    assert scalars["loss"] == [(1, 0.5), (2, 0.125)]
    assert scalars["tokens"] == [(1, 7.0)]


def test_each_write_is_flushed(tmp_path):
    writer = metrics.MetricWriter(tmp_path, use_tensorboard=False)
    writer.write(3, {"loss": 1.0})
    # Read while the writer is still open: a kill now would lose nothing.
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line)["loss"] == 1.0
    assert not (tmp_path / "tb").exists()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(4, {"loss": 1.0})


def test_appends_across_writers(tmp_path):
    # A resumed run opens a new writer on the same workdir and must not clobber the old lines.
    for step in (1, 2):
        with metrics.MetricWriter(tmp_path, use_tensorboard=False) as writer:
            writer.write(step, {"x": step})
    assert [r["x"] for r in metrics.read_metrics(tmp_path)] == [1, 2]


def test_append_writes_json_records_of_another_file(tmp_path):
    # Records that are no scalars (a batch's columns) go to their own JSON-lines file, flushed
    # at once and appended to across writers (a resumed run), as metrics.jsonl is.
    name = metrics.BRANCH_PARTS_FILE
    with metrics.MetricWriter(tmp_path, use_tensorboard=False) as writer:
        writer.append(name, {"iteration": 1, "depth": [1, 2], "between": [0.5, float("nan")]})
        assert json.loads((tmp_path / name).read_text())["depth"] == [1, 2]
        for bad in (metrics.METRICS_FILE, "sub/parts.jsonl", ""):
            with pytest.raises(ValueError, match="plain file name"):
                writer.append(bad, {})
    with metrics.MetricWriter(tmp_path, use_tensorboard=False) as writer:
        writer.append(name, {"iteration": 2})
    records = metrics.read_json_lines(tmp_path / name)
    assert [r["iteration"] for r in records] == [1, 2] and np.isnan(records[0]["between"][1])
    assert metrics.read_metrics(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        writer.append(name, {"iteration": 3})
    with metrics.MetricWriter(tmp_path, enabled=False) as writer:
        writer.append(name, {"iteration": 4})  # Another process than the lead: nothing.
    assert len(metrics.read_json_lines(tmp_path / name)) == 2


@pytest.mark.parametrize(
    "value, error, match",
    [
        (jnp.ones(3), ValueError, r"'bad' must be a scalar, got an array of shape \(3,\)"),
        (np.zeros((1,)), ValueError, "shape"),
        ("0.5", TypeError, "must be a number"),
        (None, TypeError, "must be a number"),
        (1 + 2j, TypeError, "must be a number"),
        (np.array("x"), TypeError, "non-numeric dtype"),
    ],
)
def test_rejects_non_scalars(tmp_path, value, error, match):
    with metrics.MetricWriter(tmp_path, use_tensorboard=False) as writer:
        with pytest.raises(error, match=match):
            writer.write(0, {"bad": value})
    assert metrics.read_metrics(tmp_path) == []  # Nothing half-written.


def test_rejects_reserved_names_and_float_step(tmp_path):
    with metrics.MetricWriter(tmp_path, use_tensorboard=False) as writer:
        with pytest.raises(ValueError, match="reserved"):
            writer.write(0, {"step": 1})
        with pytest.raises(TypeError, match="step must be an integer"):
            writer.write(1.5, {"x": 1})


def test_disabled_writer_writes_nothing(tmp_path):
    with metrics.MetricWriter(tmp_path / "run", enabled=False) as writer:
        writer.write(0, {"x": 1})
    assert not (tmp_path / "run").exists()


def test_read_metrics_tolerates_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0, "x": 1}\n{"step": 2, "ti')
    assert metrics.read_metrics(tmp_path) == [{"step": 1, "time": 0, "x": 1}]
    path.write_text('{"step": 1, "ti\n{"step": 2, "time": 0}\n')
    with pytest.raises(ValueError, match="line 1"):
        metrics.read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        metrics.read_metrics(tmp_path / "elsewhere")


def test_progress_silent_unless_forced(capsys):
    # Under pytest stderr is captured, i.e. not a TTY: the bar must stay quiet.
    assert list(metrics.progress(range(3), "quiet")) == [0, 1, 2]
    assert capsys.readouterr().err == ""

    assert list(metrics.progress(range(3), "loud", force=True)) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "loud" in err and "3/3" in err

    with metrics.progress(5, "manual", force=True) as bar:
        bar.update(5)
    assert "5/5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="total must be >= 0"):
        metrics.progress(-1)
