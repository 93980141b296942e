"""Tier (a): the shared flags (allreduce/cli.py) and the provenance every record carries."""
import argparse
import json
from dataclasses import dataclass
from typing import Optional

import pytest

from allreduce import records
from allreduce.cli import (add_output_flags, dataclass_flags, field_comments, out_dir, size,
                           size_list)


@dataclass(frozen=True)
class Small:
    width: int = 128            # hidden width of the mlp
    lr: float = 0.05            # learning rate,
                                # continued on the next line
    name: str = "ring"
    overlap: bool = True        # --no-overlap: all-reduce after backward
    resume: bool = False        # start from the last checkpoint
    limit: Optional[int] = None  # stop after this many steps
    # a section comment, not a field's


def parser():
    return dataclass_flags(argparse.ArgumentParser(prog="small"), Small)


def test_field_comments_are_the_help_text():
    assert field_comments(Small) == {
        "width": "hidden width of the mlp", "lr": "learning rate, continued on the next line",
        "overlap": "--no-overlap: all-reduce after backward",
        "resume": "start from the last checkpoint", "limit": "stop after this many steps"}
    text = parser().format_help()
    for phrase in ("--width WIDTH", "hidden width of the mlp", "(default: 128)",
                   "--no-overlap", "--resume", "--limit LIMIT", "--name NAME"):
        assert phrase in text, phrase


def test_flags_map_onto_the_dataclass():
    assert Small(**vars(parser().parse_args([]))) == Small()
    got = Small(**vars(parser().parse_args(["--width", "7", "--lr", "0.5", "--no-overlap",
                                            "--resume", "--limit", "3", "--name", "tree"])))
    assert got == Small(7, 0.5, "tree", False, True, 3)


def test_a_bad_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--width", "wide"])
    assert "--width" in capsys.readouterr().err


def test_a_field_no_flag_can_hold_is_refused():
    @dataclass
    class Odd:
        shape: tuple = (1, 2)
    with pytest.raises(TypeError, match="shape"):
        dataclass_flags(argparse.ArgumentParser(), Odd)


def test_output_flags_have_one_meaning(tmp_path):
    p = add_output_flags(argparse.ArgumentParser(), out_what="calibration.json")
    a = p.parse_args(["--jsonl", "r.jsonl", "--out", str(tmp_path / "new" / "dir")])
    assert a.jsonl == "r.jsonl" and (tmp_path / "new" / "dir").is_dir() is False
    assert out_dir(a.out) == a.out and (tmp_path / "new" / "dir").is_dir()
    assert "append one JSON record per row" in p.format_help()
    assert "calibration.json into DIR" in p.format_help()


def test_size_types():
    assert size("64MiB") == 64 << 20 and size_list("4K,1.5M") == [4096, 3 << 19]
    for bad in ("4Q", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            size_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="'x'"):
        size("x")


def test_provenance_has_the_fields_every_record_carries(monkeypatch):
    monkeypatch.setattr(records, "mpi_version", lambda: "MPICH Version: 4")   # no mpiexec here
    prov = records.provenance()
    assert {"commit", "host", "mpi", "python", "torch", "numpy", "cores", "env"} <= set(prov)
    assert prov["commit"] is None or len(prov["commit"]) == 40


def test_a_calibration_is_a_file_or_the_directory_holding_it(tmp_path):
    (tmp_path / "calibration.json").write_text(json.dumps({"alpha_s": 1e-5}))
    assert records.read_calibration(str(tmp_path)) == {"alpha_s": 1e-5}
    assert records.read_calibration(str(tmp_path / "calibration.json")) == {"alpha_s": 1e-5}
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no calibration.json"):
        records.calibration_file(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        records.calibration_file(str(tmp_path / "missing.json"))
