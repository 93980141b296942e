"""Tier (a): every console script of setup.cfg is installed and shows its own --help;
every flag of the tools that share allreduce/cli.py's flags says what it does.

The scripts are those `pip install -e .` wrote beside this Python; after a change
to setup.cfg's entry points run `.venv/bin/pip install -q -e . --no-deps` again.
"""
import importlib
import os
import sys

import pytest

from conftest import console_scripts, run


SCRIPTS = console_scripts()


def test_the_experiments_have_console_scripts():
    assert {"topolab-sweep", "topolab-report", "topolab-calibrate", "topolab-simulate"} \
        <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_installed_script_shows_its_own_help(script):
    path = os.path.join(os.path.dirname(sys.executable), script)
    assert os.path.exists(path), (f"{script} is not installed: run "
                                  f"`.venv/bin/pip install -q -e . --no-deps`")
    module = SCRIPTS[script].split(":")[0]
    result = run([path, "--help"], 120)
    assert result.returncode == 0, result.stderr[-2000:]
    usage = result.stdout.splitlines()[0]
    # its own parser: the usage line names this tool (python -m MODULE, or the script)
    tool = module.removesuffix(".cli")
    assert usage.startswith("usage:") and (tool in usage or script in usage), usage


# The parsers of the tools built on allreduce/cli.py: no flag without help text.
PARSERS = ["allreduce.bench_config", "strategies.bench", "strategies.bench_parallel",
           "experiments.calibrate", "experiments.simulate", "experiments.sweep"]


@pytest.mark.parametrize("module", PARSERS)
def test_every_flag_has_help(module):
    parser = importlib.import_module(module).parser()
    silent = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert silent == [], f"{module}: flags without help text: {silent}"
