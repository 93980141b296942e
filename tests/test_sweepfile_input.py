"""Sweep files with values of the wrong type or shape: `file:line: reason`, never a
traceback, and nothing run; a name that would put the results outside results/ is refused."""
import sys

import pytest
from conftest import mpi_env, run

from experiments.sweep import SweepError, load_sweep, main

# (file text, the line and reason the rejection must name)
BAD = {
    "name is a number": ('[sweep]\nname = 5\n', ":2: name must be a string, got 5"),
    "name climbs out of results/": ('[sweep]\nname = "../../x"\n',
                                    ":2: name '../../x' must be a plain folder name"),
    "name is a path": ('[sweep]\nname = "a/b"\n', ":2: name 'a/b' must be a plain folder name"),
    "command is a list": ('[[run]]\ncommand = ["allreduce.bench"]\n',
                          ":2: command ['allreduce.bench'] is not one of"),
    "command is missing": ('[sweep]\nname = "x"\n[[run]]\nworld_size = 2\n',
                           ":3: no command in this [[run]]"),
    "[[sweep]]": ('[[sweep]]\nname = "x"\n', ":1: [sweep] is one table: write [sweep]"),
    "[run]": ('[sweep]\nname = "x"\n\n[run]\ncommand = "allreduce.bench"\n',
              ":4: [[run]] is an array of tables"),
    "run = 5": ('run = 5\n', ":1: [[run]] is an array of tables"),
    "sweep timeout is text": ('[sweep]\ntimeout_s = "soon"\n',
                              ":2: timeout_s must be a number of seconds > 0, got 'soon'"),
    "run timeout is text": ('[[run]]\ncommand = "psrv.bench"\ntimeout_s = "soon"\n',
                            ":3: timeout_s must be a number of seconds > 0, got 'soon'"),
    "timeout is negative": ('[sweep]\ntimeout_s = -1\n', ":2: timeout_s must be a number"),
    "timeout is a switch": ('[sweep]\ntimeout_s = true\n', ":2: timeout_s must be a number"),
    "label is a number": ('[[run]]\ncommand = "psrv.bench"\nlabel = 3\n',
                          ":3: label must be a string, got 3"),
    "scalar given a list": ('[[run]]\ncommand = "allreduce.bench"\niters = [1, 2]\n',
                            ":3: iters must be a whole number, got [1, 2]"),
    "ranks per node is text": ('[[run]]\ncommand = "allreduce.bench"\nworld_size = 4\n'
                               'ranks_per_node = "2"\n',
                               ":4: ranks_per_node must be a whole number, got '2'"),
    "one axis value is text": ('[[run]]\ncommand = "strategies.train"\nsteps = [3, "x"]\n',
                               ":3: steps must be a whole number, got 'x'"),
    "switch is text": ('[[run]]\ncommand = "experiments.calibrate"\nps = "no"\n',
                       ":3: ps must be true or false, got 'no'"),
    "value is a table": ('[[run]]\ncommand = "allreduce.bench"\nworld_size = {a = 1}\n',
                         ":3: world_size must be a whole number, got {'a': 1}"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD))
def test_wrong_types_name_their_line_and_reason(tmp_path, case):
    text, expected = BAD[case]
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(SweepError) as e:
        load_sweep(str(path))
    assert f"s.toml{expected}" in str(e.value), str(e.value)


@pytest.mark.timeout(30)
def test_right_types_still_load(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text('[sweep]\nname = "my sweep"\ntimeout_s = 1.5\n\n[[run]]\n'
                    'command = "strategies.train"\nsync = "local"\ntrace = true\n'
                    'steps = [2, 3]\nlr = 1\n')
    settings, points = load_sweep(str(path))
    assert settings == {"name": "my sweep", "timeout_s": 1.5} and len(points) == 2


@pytest.mark.timeout(60)
def test_cli_rejects_a_bad_type_without_a_traceback_and_runs_nothing(tmp_path):
    """The escaping name is the case that harmed: results/../../x is outside results/."""
    for text in ('[sweep]\nname = "../../escaped"\n\n[[run]]\ncommand = "psrv.bench"\n',
                 '[sweep]\nname = "x"\n\n[run]\ncommand = "psrv.bench"\n'):
        path = tmp_path / "s.toml"
        path.write_text(text)
        work = tmp_path / "a" / "b"
        work.mkdir(parents=True, exist_ok=True)
        result = run([sys.executable, "-m", "experiments.sweep", str(path)], 50, mpi_env(),
                     cwd=work)
        assert result.returncode == 2, result.stderr
        assert "sweep rejected, nothing was run" in result.stderr
        assert "Traceback" not in result.stderr and "s.toml:" in result.stderr
        assert not (tmp_path / "escaped").exists() and not (work / "results").exists()


def rejected(capsys, path, *argv):
    """experiments.sweep's main on PATH ARGV...: exit 2, the reason on one line (an
    exception out of main would be the command line's traceback)."""
    assert main([str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep rejected, nothing was run:\n")
    assert len(err.strip().splitlines()) == 2, err
    return err.splitlines()[1]


@pytest.mark.timeout(30)
def test_a_file_that_is_not_utf8_names_its_line_and_byte(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "latin1.toml"
    path.write_bytes('[sweep]\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(SweepError, match=r"latin1\.toml:2: not UTF-8 text \(byte 0xe9 at offset "
                                         r"19\); a sweep file is TOML, which is UTF-8"):
        load_sweep(str(path))
    assert "latin1.toml:2: not UTF-8" in rejected(capsys, path)
    assert not (tmp_path / "results").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, words", [
    ("", ":1: the file is empty; a sweep needs at least one [[run]]"),
    ("\n  \n", ":1: the file is empty"),
    ("# nothing yet\n", ":1: no [[run]] table; a sweep needs at least one [[run]]"),
    ('[sweep]\nname = "x"\n', ":1: no [[run]] table"),
    ("run = []\n", ":1: no [[run]] table"),
], ids=["empty", "blank lines", "a comment", "[sweep] only", "run = []"])
def test_a_sweep_with_nothing_to_run_is_refused_naming_the_file(tmp_path, monkeypatch, capsys,
                                                                  text, words):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(SweepError) as e:
        load_sweep(str(path))
    assert f"{path}{words}" in str(e.value)
    assert f"{path}{words}" in rejected(capsys, path)
    assert not (tmp_path / "results").exists()


# 1,300 x 1,300: an axis written as a range where one value was meant
HUGE = ('[[run]]\ncommand = "psrv.bench"\nworkers = [' + ", ".join(map(str, range(1, 1301)))
        + ']\nservers = [' + ", ".join(map(str, range(1, 1301))) + ']\n')
TWELVE = '[[run]]\ncommand = "psrv.bench"\nworkers = [1, 2, 3]\nservers = [1, 2, 3, 4]\n'


@pytest.mark.timeout(30)
def test_a_sweep_of_too_many_points_is_refused_with_its_count_before_any_is_made(tmp_path):
    path = tmp_path / "huge.toml"
    path.write_text(HUGE)
    with pytest.raises(SweepError) as e:
        load_sweep(str(path))
    assert str(e.value) == (f"{path}:1: 1,690,000 points, more than the limit of 10,000 "
                            f"(experiments.sweepfile.MAX_POINTS); split the sweep, or pass "
                            f"--max-points 1690000 to run them all")
    path.write_text(TWELVE)
    assert len(load_sweep(str(path), max_points=12)[1]) == 12
    with pytest.raises(SweepError, match=r":1: 12 points, more than the limit of 11 "):
        load_sweep(str(path), max_points=11)


@pytest.mark.timeout(30)
def test_max_points_on_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "twelve.toml"
    path.write_text(TWELVE)
    assert "12 points, more than the limit of 11" in rejected(capsys, path, "--max-points", "11")
    assert main([str(path), "--max-points", "12", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("psrv.bench --workers") == 12
    with pytest.raises(SystemExit) as e:
        main([str(path), "--max-points", "0"])
    assert e.value.code == 2
    assert "--max-points: a whole number of points >= 1, got '0'" in capsys.readouterr().err
