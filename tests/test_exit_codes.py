"""Every console script of setup.cfg exits 0 when it worked and non-zero when it did not.

A console script runs `sys.exit(main())`: a `main` that returns its results (a
dict, a list) makes sys.exit print them and exit 1, which a shell script or a
scheduler reads as a failure.  Each script is run as installed (.venv/bin/NAME);
one that the editable install has not generated yet runs through the same
`sys.exit(main())` line.
"""
import sys

import pytest
from conftest import BIN, console_scripts, mpi_env, run

TINY_MLP = ["--model", "mlp", "--width", "8", "--depth", "1", "--in-dim", "4", "--classes", "3",
            "--dataset-size", "32", "--global-batch", "8", "--threads", "1", "--no-progress"]


def command_of(name):
    installed = BIN / name
    if installed.exists():
        return [str(installed)]
    module, function = console_scripts()[name].split(":")
    return [sys.executable, "-c", f"import sys\nfrom {module} import {function}\n"
                                  f"sys.exit({function}())"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_help_exits_0(name):
    result = run(command_of(name) + ["--help"], 100, mpi_env())
    assert result.returncode == 0, f"{name} --help: exit {result.returncode}\n{result.stderr}"
    assert "usage" in result.stdout.lower(), result.stdout


@pytest.mark.timeout(120)
def test_train_exits_0_after_a_run_and_2_on_a_bad_flag(tmp_path):
    jsonl = tmp_path / "run.jsonl"
    ok = run(command_of("topolab-train") + TINY_MLP + ["--sync", "local", "--steps", "2",
                                                      "--jsonl", str(jsonl)], 100, mpi_env())
    assert ok.returncode == 0, f"exit {ok.returncode}\n{ok.stdout}\n{ok.stderr}"
    assert "{'kind': 'summary'" not in ok.stderr          # sys.exit printed no dict
    assert "loss" in ok.stdout and jsonl.exists()
    bad = run(command_of("topolab-train") + TINY_MLP + ["--lr", "-1"], 100, mpi_env())
    assert bad.returncode == 2 and "--lr must be > 0" in bad.stderr, bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_bench_exits_0_after_a_run_and_non_zero_on_a_bad_method():
    args = TINY_MLP + ["--rounds", "1", "--steps-per-round", "1", "--warmup", "0"]
    ok = run(command_of("topolab-train-bench") + args + ["--syncs", "local"], 100, mpi_env())
    assert ok.returncode == 0, f"exit {ok.returncode}\n{ok.stdout}\n{ok.stderr}"
    assert "samples/s" in ok.stdout and "'kind': 'bench'" not in ok.stderr
    bad = run(command_of("topolab-train-bench") + args + ["--syncs", "nonsense"], 100, mpi_env())
    assert bad.returncode == 2 and "unknown method 'nonsense'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
