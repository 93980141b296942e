"""max and min propagate NaN on every algorithm, every backend and every rank.

MPI_MAX/MPI_MIN and gloo's max/min compare, so a NaN won or lost by its place
in the reduction (ranks could even end with different answers); the textbook
algorithms use numpy's and torch's maximum/minimum, which return NaN.  The
rule is NaN wherever any rank had one (docs/reliability.md).
"""
import pytest

from conftest import check_ok, mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_max_and_min_propagate_nan_on_every_algorithm_and_rank(P):
    result = check_ok(mpirun(P, ["tests/mpi/nan_minmax.py"], timeout=280))
    assert f"OK P={P}" in result.stdout
