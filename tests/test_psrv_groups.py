"""Keys with a group of their own: a pipeline stage's or a tp rank's replicas push only
their keys, and the servers wait for that group alone (psrv/store.py, protocol 4's GROUP).

Four workers over one server shard: workers {0, 1} push the keys of "stage 0", workers
{2, 3} those of "stage 1", and every worker numbers the keys alike from the shapes of
both stages.  Gradients are multiples of 1/8 and lr a power of two, so every sum is
exact in float32 and the values compare with `==`.
"""
import threading

import numpy as np
import pytest

import psrv
from psrv.link import PSError

STAGES = {0: {"s0.w": (3, 4), "s0.b": (4,)}, 1: {"s1.w": (4, 2)}}
GROUPS = {0: (0, 1), 1: (2, 3)}
SHAPES = {n: s for stage in STAGES.values() for n, s in stage.items()}
SGD = psrv.OptimizerConfig("sgd", lr=0.5)


def start(stage, w):
    """The values a worker holds before INIT; the group's first one's win."""
    return {n: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 5) / 4 + w
            for n, s in STAGES[stage].items()}


def grad(stage, step, w):
    return {n: ((np.arange(np.prod(s)) % 4 - 1.5) * 0.25 * (1 + (step + 2 * w) % 3)
                ).astype(np.float32).reshape(s) for n, s in STAGES[stage].items()}


def train(endpoints, stage, w, steps, mode, results):
    client = psrv.Client(endpoints, w, 4, timeout=20,
                         consistency=psrv.Consistency(mode, 1 if mode == "ssp" else 0))
    with client:
        params = start(stage, w)
        client.init(params, SGD, group=GROUPS[stage], shapes=SHAPES)
        for step in range(steps):
            client.push_pull(grad(stage, step, w), params, step).wait()
        results[w] = params


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_each_group_averages_its_own_keys(mode):
    steps, results = 3, {}
    # the launcher knows the keys: the shard's receive queue is one step's messages of a
    # worker (launch.step_messages), set at its bind, never changed while workers join
    with psrv.launch.start_local_servers(1, shapes=SHAPES) as servers:
        threads = [threading.Thread(target=train, args=(servers.endpoints, stage, w, steps,
                                                        mode, results))
                   for stage, group in GROUPS.items() for w in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
        counted = psrv.launch.step_messages(SHAPES, 1)[0]        # 2 x 3 keys + 4
        assert f"{counted} messages queued per connection" in servers.log(0)
    assert sorted(results) == [0, 1, 2, 3]
    for stage, group in GROUPS.items():
        # the group's first worker's values, minus lr times the mean over the group of
        # every step's gradients (asp: each applied at once, divided by the group's size)
        want = {n: v.astype(np.float64) for n, v in start(stage, group[0]).items()}
        for step in range(steps):
            for w in group:
                for n, g in grad(stage, step, w).items():
                    want[n] -= 0.5 * g / len(group)
        for w in group:
            if mode == "bsp":           # asp: a worker's last pull may miss the other's push
                for n in want:
                    np.testing.assert_array_equal(results[w][n], want[n].astype(np.float32))
            assert sorted(results[w]) == sorted(STAGES[stage])


@pytest.mark.timeout(60)
def test_a_worker_outside_a_keys_group_may_not_push_it():
    with psrv.launch.start_local_servers(1) as servers:
        outsider = psrv.Client(servers.endpoints, 2, 4, timeout=10)
        owner = psrv.Client(servers.endpoints, 0, 4, timeout=10)
        try:
            owner_params = start(0, 0)
            # worker 0 brings stage 0's values; worker 2 declares them as if its group's
            t = threading.Thread(target=owner.init, args=(owner_params, SGD),
                                 kwargs=dict(group=(0, 1), shapes=SHAPES))
            t.start()
            t.join(20)
            with pytest.raises(PSError, match="other keys than this shard holds|not by worker"):
                outsider.init(start(0, 2), SGD, group=(2, 3), shapes=SHAPES)
        finally:
            owner.close()
            outsider.close()


def test_a_group_must_hold_its_worker():
    with psrv.launch.start_local_servers(1) as servers:
        client = psrv.Client(servers.endpoints, 2, 4, timeout=10)
        try:
            with pytest.raises(ValueError, match="must hold worker 2"):
                client.init(start(0, 2), SGD, group=(0, 1), shapes=SHAPES)
        finally:
            client.close()
