"""Bad values get one line naming them and exit 2, before any work; bad data is refused.

    command lines       psrv.server, psrv.example, psrv.bench, psrv.keys: every value is
                        checked where it is parsed (no hang, no spin, no traceback)
    key files           a directory where a key file should be, a file where DIR should be,
                        an existing key set (whose directory keeps its mode)
    INIT and PUSH       a non-finite lr, eps or weight_decay, NaN or inf in a gradient or an
                        initial value: an ERROR naming the worker (and key), nothing applied
    SIGTERM             a psrv.bench point stopped mid-run leaves no psrv-* file behind
"""
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import zmq

import psrv
from conftest import ROOT, run
from psrv import keys as K
from psrv import protocol as P
from psrv.config import CONFIG, Consistency, OptimizerConfig

SGD = OptimizerConfig("sgd", lr=0.5)


def refused(module, *args, env=None):
    """Run python -m module args; -> its one-line stderr, after checking exit 2."""
    result = run([sys.executable, "-m", module, *map(str, args)], 30,
                 env=env or {**os.environ, "PYTHONPATH": str(ROOT)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, f"exit {result.returncode}: {result.stderr}"
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, says", [
    (["--worker-timeout", "-1"], "worker_timeout must be a finite number of seconds > 0"),
    (["--worker-timeout", "0"], "worker_timeout must be a finite number of seconds > 0"),
    (["--join-timeout", "nan"], "join_timeout must be a finite number of seconds > 0"),
    (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
    (["--max-unread-mib", "0"], "max_unread must be a finite number of bytes > 0"),
    (["--step-messages", "0"], "step_messages must be a whole number of messages >= 1"),
])
def test_server_options_are_checked_before_it_serves(flags, says):
    """-1 used to ignore SIGTERM forever and 0 to spin at 100 % CPU."""
    assert says in refused("psrv.server", *flags)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_and_bench_flags_are_checked_before_any_work(tmp_path):
    assert "staleness must be >= 0, got -1" in refused("psrv.example", "--staleness", "-1")
    assert "--lr must be finite and > 0, got inf" in refused("psrv.example", "--lr", "inf")
    assert "--worker-id 2 is not below --num-workers 2" in refused(
        "psrv.example", "--ps", "tcp://127.0.0.1:9", "--worker-id", "2", "--num-workers", "2")
    line = refused("psrv.example", "--ps", "tcp://127.0.0.1:9", "--keys", tmp_path / "none")
    assert line.startswith("psrv.example: --keys: key file") and "does not exist" in line
    assert "--workers '0': every count must be >= 1" in refused("psrv.bench", "--workers", "0")
    assert "--servers '1,x'" in refused("psrv.bench", "--servers", "1,x")


@pytest.mark.timeout(60)
def test_key_files_and_directories_are_refused_for_the_right_reason(tmp_path):
    existing = tmp_path / "existing"
    (existing / "workers").mkdir(parents=True)
    existing.chmod(0o755)
    (existing / "server.key").write_text("")
    line = refused("psrv.keys", existing, "--workers", "1")
    assert "server.key exists: keys are never overwritten" in line
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755       # untouched, not chmod 0700
    assert os.listdir(existing / "workers") == []
    (tmp_path / "file").write_text("")
    assert "file exists and is not a directory" in refused("psrv.keys", tmp_path / "file",
                                                           "--workers", "1")
    keys = tmp_path / "keys"
    K.generate(str(keys), 1)
    os.unlink(keys / "server.key_secret")
    (keys / "server.key_secret").mkdir(mode=0o755)
    with pytest.raises(ValueError, match="server.key_secret is not a regular file"):
        K.load_server_keys(str(keys))
    assert "server.key_secret is not a regular file" in refused("psrv.server", "--keys", keys)


def test_non_finite_optimizer_values_are_refused_on_construction():
    for bad in (dict(lr=float("inf")), dict(lr=float("nan")), dict(eps=float("inf")),
                dict(weight_decay=float("inf")), dict(weight_decay=float("nan"))):
        with pytest.raises(ValueError, match="finite"):
            OptimizerConfig("adam", **bad)


def raw_init(lr=0.5, eps=1e-8, weight_decay=0.0, value=None, worker=0):
    """An INIT of one 4-element key whose config is packed by hand (OptimizerConfig
    itself refuses these values): what another implementation could send."""
    config = CONFIG.pack(0, lr, 0.0, 0.9, 0.999, eps, weight_decay, 0, 0, 1)
    payload = [value] if value is not None else []
    return P.encode(P.Op.INIT, worker, 1, [P.Entry(0, 0, 4, (4,), nframes=len(payload))],
                    [config, b"b"], payload)


@pytest.mark.timeout(60)
def test_an_init_with_non_finite_values_is_refused_naming_the_worker():
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(servers.endpoints[0])
        for frames, says in [
            (raw_init(lr=float("inf")), "INIT from worker 0: lr must be finite and > 0, got inf"),
            (raw_init(eps=float("inf")), "INIT from worker 0: need finite eps > 0"),
            (raw_init(weight_decay=float("nan")), "INIT from worker 0: need finite eps > 0 and "
                                                  "weight_decay >= 0, got eps 1e-08, weight_decay nan"),
            (raw_init(value=np.array([0, 1, np.inf, 3], np.float32)),
             "worker 0 sent an initial value with NaN or inf for key 0"),
        ]:
            sock.send_multipart(frames)
            assert sock.poll(10_000)
            reply = P.decode(sock.recv_multipart())
            assert reply.op == P.Op.ERROR and says in bytes(reply.extras[0]).decode()
        sock.close()
        ctx.term()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_gradient_is_refused_and_nothing_is_applied(bad):
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        with psrv.Client(servers.endpoints, 0, 1, timeout=10,
                         consistency=Consistency("asp")) as client:
            params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
            client.init(params, SGD)
            grads = {"w": np.full((3, 4), 0.5, np.float32), "b": np.full(4, 0.25, np.float32)}
            grads["w"][1, 2] = bad
            with pytest.raises(psrv.PSError, match=r"worker 0 sent a gradient with NaN or inf "
                                                   r"for key \d+ \(w\[0:12\] of shape \(3, 4\)\)"):
                client.push_pull(grads, params, 0).wait()
            out = {n: np.empty_like(p) for n, p in params.items()}
            client.pull_async(out).wait()
            np.testing.assert_array_equal(out["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
            np.testing.assert_array_equal(out["b"], np.ones(4, np.float32))   # the message whole


def test_the_finite_check_passes_huge_finite_values_and_finds_any_inf_or_nan():
    """store.Shard.check_finite reads a frame's dot product first: its square
    overflows for finite values above 2**64, which the exact test then lets through."""
    from types import SimpleNamespace

    from psrv.store import Shard
    shard, entry = Shard(0), SimpleNamespace(key=0)
    shard.keys[0] = SimpleNamespace(describe=lambda: "w[0:4096] of shape (4096,)")
    huge = np.full(4096, 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(huge, huge))
    shard.check_finite(entry, 0, [np.ones(4096, np.float32).data, huge.data])
    for bad in (np.nan, np.inf, -np.inf):
        g = huge.copy() if bad == np.inf else np.ones(4096, np.float32)
        g[4095] = bad
        with pytest.raises(ValueError, match=r"worker 0 sent a gradient with NaN or inf "
                                             r"for key 0 \(w\[0:4096\]"):
            shard.check_finite(entry, 0, [np.ones(4096, np.float32).data, g.data])


def shard_log(directory):
    """The text of psrv.bench's first server log in directory, or None before there is one."""
    names = [n for n in os.listdir(directory) if n.startswith("psrv-shard")]
    return open(os.path.join(directory, names[0])).read() if names else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["starting", "running"])
def test_a_bench_point_stopped_by_sigterm_leaves_no_temporary_files(when):
    """SIGTERM as the server starts (its log just made), or while the workers run."""
    tmp = tempfile.mkdtemp(prefix="t")         # short: ipc:// paths are at most 107 bytes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp}
    bench = subprocess.Popen([sys.executable, "-m", "psrv.bench", "--sizes", "4K", "--workers",
                              "1", "--servers", "1", "--reps", "100000", "--no-rpc"], cwd=ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        end = time.monotonic() + 60
        ready = "" if when == "starting" else "shard 0 on ipc://"
        while ready not in (shard_log(tmp) or "") or shard_log(tmp) is None:
            assert bench.poll() is None and time.monotonic() < end, bench.stderr.read()
            time.sleep(0.1)
        if when == "running":
            time.sleep(2)                       # the workers are spawned and measuring
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert [n for n in os.listdir(tmp) if n.startswith("psrv")] == []
    finally:
        try:
            os.killpg(bench.pid, signal.SIGKILL)     # whatever is left of its process group
        except ProcessLookupError:
            pass
        bench.wait(10)
        bench.stderr.close()
        subprocess.run(["rm", "-rf", tmp])
