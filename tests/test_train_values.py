"""Tier (a)/(c): every value of the trainer checked where it is parsed, and the outputs
checked before any work: one line and exit 2 instead of a traceback, or instead of a
run that trains to the end and then loses what it made.  Checkpoints stay their owner's."""
import os
import stat
import sys

import pytest
from conftest import run

from strategies.config.settings import ConfigError, TrainConfig, check_outputs, parse_args


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "-1"], "--timeout must be > 0, got -1.0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "nan"], "--timeout must be a finite number, got nan"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--sync", "ps", "--momentum", "1.5"], "--momentum must be < 1, got 1.5"),
    (["--loss-scale", "inf", "--precision", "fp16"], "--loss-scale must be a finite number"),
    (["--straggler", "0:inf"], "--straggler '0:inf' needs RANK >= 0 and SECONDS >= 0"),
])
def test_a_bad_value_is_named_where_it_is_parsed(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        parse_args(argv)
    assert e.value.field is not None


def test_the_outputs_are_checked_before_the_run(tmp_path):
    missing = tmp_path / "no" / "such"
    for field in ("params_out", "trace", "jsonl"):
        cfg = TrainConfig(**{field: str(missing / "f")})
        with pytest.raises(ConfigError, match=f"no folder {missing}") as e:
            check_outputs(cfg, writer=True)
        assert e.value.field == field
        check_outputs(cfg, writer=False)            # another rank writes it
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_outputs(TrainConfig(checkpoint_dir=str(tmp_path / "a_file")), writer=False)
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        check_outputs(TrainConfig(params_out=str(tmp_path)), writer=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_missing_folder_stops_the_run_before_training_and_checkpoints_are_private(tmp_path):
    base = [sys.executable, "-m", "strategies.train", "--steps", "2", "--no-progress",
            "--threads", "1"]
    bad = run(base + ["--params-out", str(tmp_path / "no" / "p.npz")], 60)
    assert bad.returncode == 2 and "no folder" in bad.stderr and "Traceback" not in bad.stderr
    assert "steps=" not in bad.stdout                            # nothing was trained
    ckpt = tmp_path / "ckpt"
    assert run(base + ["--checkpoint-dir", str(ckpt)], 60).returncode == 0
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ckpt / "checkpoint.pt").st_mode) == 0o600
