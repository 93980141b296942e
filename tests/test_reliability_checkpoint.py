"""Tier (c): a split run's checkpoint set knows itself (strategies/runtime/checkpoint/sets.py).

Small grid runs under mpiexec write sets of steps 2 and 4; each case damages a copy
of them as a crash, a disk or a hand would, then resumes.  A flipped byte, swapped
shares (two ZeRO shards; two tp pieces), a share copied over another, a file of
another step or of another run: refused on every rank in one line naming the file,
exit 2, no traceback.  A newest set whose writing was stopped (no manifest), with
an older complete one: every rank says so, the run resumes from the older one, and
the temporary files a killed writer left are gone.
"""
import shutil
import sys

import pytest
import torch

from conftest import check_ok, mpi_env, mpirun, run

GPT = ["--model", "gpt", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
       "--vocab", "64", "--global-batch", "8", "--sync", "ring", "--threads", "1",
       "--no-progress"]
DP_PP = GPT + ["--dp", "2", "--pp", "2", "--zero", "1"]
TP_Z3 = GPT + ["--dp", "2", "--tp", "2", "--zero", "3"]
RANKS = 4


def train(flags, ckpt, *extra, timeout=120):
    return mpirun(RANKS, ["-m", "strategies.train", *flags, "--checkpoint-dir", ckpt, *extra],
                  timeout=timeout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: checkpoint folder}: dp2 x pp2 x ZeRO-1 and dp2 x tp2 x ZeRO-3, sets of
    steps 2 and 4; and a second dp2 x pp2 run (another seed), for a foreign file."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name, flags, extra in (("dp_pp", DP_PP, []), ("tp_z3", TP_Z3, []),
                               ("other", DP_PP, ["--seed", "1"])):
        out[name] = root / name
        check_ok(train(flags, out[name], "--steps", "4", "--checkpoint-every", "2", *extra))
    return out


def copy_of(saved, name, tmp_path):
    ckpt = tmp_path / name
    shutil.copytree(saved[name], ckpt)
    return ckpt


def assert_refused(result, path, says):
    """rc 2, one line per rank naming the file, `says` in it, no traceback.  A rank
    whose own file is bad names its own (a swap: both files are named)."""
    err = result.stderr
    assert result.returncode == 2, f"exit {result.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert sorted(int(line.split()[2].rstrip(":")) for line in lines) == list(range(RANKS)), err
    assert all(str(path.parent) in line and "--resume:" in line for line in lines), err
    assert all(f"{path} " in line and says in line for line in lines
               if "failed:" in line), err
    assert any(f"{path} " in line for line in lines if "failed:" not in line), err


def flip_inside_a_tensor(path, count=32):
    """Flip `count` bytes in the middle of the file's largest tensor's data."""
    state = torch.load(path, weights_only=True)
    tensors = [t for t in state["model"].values() if torch.is_tensor(t)]
    data = max(tensors, key=lambda t: t.numel()).contiguous().view(torch.uint8).numpy().tobytes()
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    assert at > 0 and raw.find(data, at + 1) < 0
    middle = at + len(data) // 2
    for i in range(middle, middle + count):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def swap(a, b):
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.timeout(600)
def test_a_damaged_set_is_refused_on_every_rank_naming_the_file(saved, tmp_path):
    cases = []
    ckpt = copy_of(saved, "dp_pp", tmp_path / "flipped")
    flip_inside_a_tensor(ckpt / "step-4" / "rank-1.pt")
    cases.append((DP_PP, ckpt, ckpt / "step-4" / "rank-1.pt", "is damaged"))

    ckpt = copy_of(saved, "dp_pp", tmp_path / "zero_shards_swapped")
    swap(ckpt / "step-4" / "rank-0.pt", ckpt / "step-4" / "rank-2.pt")
    cases.append((DP_PP, ckpt, ckpt / "step-4" / "rank-0.pt", "holds the share of rank 2"))

    ckpt = copy_of(saved, "dp_pp", tmp_path / "copied")
    shutil.copy(ckpt / "step-4" / "rank-0.pt", ckpt / "step-4" / "rank-2.pt")
    cases.append((DP_PP, ckpt, ckpt / "step-4" / "rank-2.pt", "holds the share of rank 0"))

    ckpt = copy_of(saved, "tp_z3", tmp_path / "tp_swapped")
    swap(ckpt / "step-4" / "rank-0.pt", ckpt / "step-4" / "rank-1.pt")
    cases.append((TP_Z3, ckpt, ckpt / "step-4" / "rank-0.pt", "tp 1"))

    ckpt = copy_of(saved, "dp_pp", tmp_path / "torn")       # steps {4, 2, 4, 4}
    shutil.copy(ckpt / "step-2" / "rank-1.pt", ckpt / "step-4" / "rank-1.pt")
    cases.append((DP_PP, ckpt, ckpt / "step-4" / "rank-1.pt", "is of step 2"))

    ckpt = copy_of(saved, "dp_pp", tmp_path / "foreign")
    shutil.copy(saved["other"] / "step-4" / "rank-3.pt", ckpt / "step-4" / "rank-3.pt")
    cases.append((DP_PP, ckpt, ckpt / "step-4" / "rank-3.pt", "is foreign"))

    for flags, ckpt, path, says in cases:
        assert_refused(train(flags, ckpt, "--steps", "6", "--resume"), path, says)


@pytest.mark.timeout(300)
def test_an_unfinished_newest_set_falls_back_to_the_complete_one(saved, tmp_path):
    """A kill between the ranks' files of step 4 and its manifest (the manifest and
    rank 3's file missing), with temporary files left by killed writers."""
    ckpt = copy_of(saved, "dp_pp", tmp_path)
    (ckpt / "step-4" / "manifest.json").unlink()
    (ckpt / "step-4" / "rank-3.pt").unlink()
    left = [ckpt / "step-4" / "rank-3.pt.tmp.999999", ckpt / "step-2" / "rank-1.pt.tmp.999998",
            ckpt / "rank-0.pt.tmp.999997"]
    for path in left:
        path.write_bytes(b"\0" * 4096)
    result = check_ok(train(DP_PP, ckpt, "--steps", "6", "--resume"))
    notes = [line for line in result.stderr.splitlines() if "note:" in line]
    assert len(notes) == RANKS, result.stderr
    assert all("set of step 4" in line and "resuming from step 2" in line for line in notes)
    assert "resumed at step 2" in result.stdout
    assert not [p for p in left if p.exists()]
    # the new set of step 6 (at the end) and the complete one before it; the torn one gone
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-6"]
    assert (ckpt / "step-6" / "manifest.json").exists()


# ---------------------------------------------------------------- tier (a): the digest
def test_the_digest_survives_save_and_load_and_sees_one_flipped_bit(tmp_path):
    from strategies.runtime.checkpoint import digest
    state = {"step": 3, "place": {"rank": 1, "dp": 0}, "layout": ("dp", 2),
             "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                       "h": torch.ones(2, dtype=torch.bfloat16), "n": torch.tensor(7)}}
    torch.save(state, tmp_path / "s.pt")
    again = torch.load(tmp_path / "s.pt", weights_only=True)
    assert digest(again) == digest(state)
    flipped = again["model"]["w"].view(torch.int32)
    flipped[1, 2] ^= 1
    assert digest(again) != digest(state)
    moved = dict(state, place={"rank": 0, "dp": 1})
    assert digest(moved) != digest(state)


@pytest.mark.timeout(120)
def test_a_flipped_plain_checkpoint_is_refused(tmp_path):
    """Plain data parallelism (one checkpoint.pt, one process) carries the digest too."""
    cmd = [sys.executable, "-m", "strategies.train", "--steps", "2", "--no-progress",
           "--threads", "1", "--checkpoint-dir", tmp_path]
    check_ok(run(cmd, 90, mpi_env()))
    flip_inside_a_tensor(tmp_path / "checkpoint.pt")
    result = run(cmd[:4] + ["4"] + cmd[5:] + ["--resume"], 90, mpi_env())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{tmp_path / 'checkpoint.pt'} is damaged" in result.stderr
