"""Lab 6's self-check (experiments/labs/check_cluster.py) accepts right answers and rejects
wrong ones without giving the expected figures away.  Pure: no cluster, no MPI."""
import pytest

from experiments.labs import check_cluster

N = 16 << 20                 # 16 MiB
MS = N * 8e-9 * 1e3          # n bytes through a 1 Gbit/s link, in ms: 134.2

# Worked by hand (the teacher's sheet): bytes the busiest host sends across its link, and
# ms if only the link took time.  2 x 2: ring 2(P-1)/P n = 1.5 n; tree n (host 1 sends
# its sum up, host 0 the result down, one after the other: 2 n of time); halving-doubling
# n/2 from both ranks of a host in its first and last steps: 2 n; hierarchical the
# leaders' ring over 2 hosts: n.  4 x 1: the tree's root sends n to hosts 1 and 2.
RIGHT = f"""
bytes = {N}
gbps = 1
[2x2]
ring = {1.5 * N:.0f}
tree = {N}
halving_doubling = {2 * N}
hierarchical = {N}
[2x2.link_ms]
ring = {1.5 * MS:.1f}
tree = {2 * MS:.1f}
halving_doubling = {2 * MS:.1f}
hierarchical = {MS:.1f}
[4x1]
ring = {1.5 * N:.0f}
tree = {2 * N}
halving_doubling = {1.5 * N:.0f}
hierarchical = {1.5 * N:.0f}
[4x1.link_ms]
tree = {4 * MS:.1f}
"""


def check(tmp_path, capsys, text):
    path = tmp_path / "my_cluster.toml"
    path.write_text(text)
    code = check_cluster.main([str(path)])
    return code, capsys.readouterr().out


@pytest.mark.timeout(10)
def test_right_answers_pass(tmp_path, capsys):
    code, out = check(tmp_path, capsys, RIGHT)
    assert code == 0 and out.strip().endswith("PASS"), out
    assert out.count("ok ") == 13


@pytest.mark.timeout(10)
@pytest.mark.parametrize("old, new, right", [
    (f"ring = {1.5 * N:.0f}\ntree = {N}", f"ring = {2 * N}\ntree = {N}",      # forgot (P-1)/P
     f"{1.5 * N:.0f}"),
    (f"hierarchical = {N}\n[2x2.link_ms]", f"hierarchical = {2 * N}\n[2x2.link_ms]", f"{N}"),
    (f"tree = {2 * MS:.1f}", f"tree = {MS:.1f}", f"{2 * MS:.1f}"),     # bytes / rate: one way
    (f"[4x1]\nring = {1.5 * N:.0f}\ntree = {2 * N}", f"[4x1]\nring = {1.5 * N:.0f}\ntree = {N}",
     f"{2 * N}"),
])
def test_a_wrong_answer_fails_and_is_not_corrected(tmp_path, capsys, old, new, right):
    assert old in RIGHT
    code, out = check(tmp_path, capsys, RIGHT.replace(old, new, 1))
    assert code == 1 and "FAIL: 1 of 13 wrong" in out, out
    wrong = [line for line in out.splitlines() if line.startswith("WRONG")]
    assert len(wrong) == 1 and right not in wrong[0], wrong
    assert "expected" not in out.lower()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, message", [
    ("gbps = 1\n[2x2]\nring = 1\n", "bytes = N"),
    (f"bytes = {N}\ngbps = 1\n", "no layout"),
    (f"bytes = {N}\ngbps = 1\n[2by2]\nring = 1\n", "not a layout"),
    (f"bytes = {N}\ngbps = 1\n[2x2]\nrings = 1\n", "not one of"),
])
def test_a_malformed_file_is_refused_with_the_reason(tmp_path, capsys, text, message):
    code, out = check(tmp_path, capsys, text)
    assert code == 2 and message in out, out
