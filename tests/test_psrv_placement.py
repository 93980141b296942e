"""Tier (a): placement is byte-balanced, covers every element once, and is deterministic;
the launcher counts each shard's messages of a step from it (the receive queue's size)."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from psrv import Placement
from psrv.launch import CONTROL_MESSAGES, step_messages
from psrv.server import MOST_RECEIVE_HWM, RECEIVE_HWM, receive_hwm

shapes_st = st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=8),
                            st.lists(st.integers(1, 60), min_size=0, max_size=3).map(tuple),
                            min_size=1, max_size=12)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(shapes_st, st.integers(1, 5), st.sampled_from([1000, 4096, 1 << 20]))
def test_slices_cover_each_parameter_once_and_balance(shapes, servers, slice_bytes):
    p = Placement(shapes, servers, slice_bytes)
    for name, shape in shapes.items():
        sl = p.by_name[name]
        assert [s.offset for s in sl] == [0] + [s.offset + s.length for s in sl[:-1]]
        assert sum(s.length for s in sl) == math.prod(shape)
        assert all(s.length * 4 <= max(slice_bytes, 4) for s in sl) or len(sl) == 1
    assert sorted(s.key for s in p.slices) == list(range(len(p.slices)))
    biggest = max(s.length * 4 for s in p.slices)
    assert max(p.server_bytes) - min(p.server_bytes) <= biggest     # LPT with small pieces
    assert sum(p.server_bytes) == 4 * sum(math.prod(s) for s in shapes.values())


@pytest.mark.timeout(30)
def test_big_tensor_is_spread_over_servers_and_placement_is_deterministic():
    shapes = {"layer1.weight": (1000, 1000), "layer1.bias": (1000,), "head": (10, 1000)}
    a = Placement(shapes, 3, slice_bytes=1 << 20)
    b = Placement(dict(reversed(list(shapes.items()))), 3, slice_bytes=1 << 20)
    assert a.slices == b.slices and str(a) == str(b)
    assert {s.server for s in a.by_name["layer1.weight"]} == {0, 1, 2}
    assert a.imbalance() < 1.05        # loads differ by at most one 1 MiB slice
    assert max(a.server_bytes) - min(a.server_bytes) <= max(s.length * 4 for s in a.slices)
    assert "bytes per server" in str(a)
    with pytest.raises(ValueError, match="num_servers"):
        Placement(shapes, 0)


@pytest.mark.timeout(30)
def test_a_shards_step_is_two_messages_per_key_it_holds_and_its_queue_stays_in_bounds():
    """A push (or push_pull) and a pull carry at most one message per key of the shard
    each (the client batches slices, one at least per message), plus control messages;
    the shard's receive queue is that, within [8, 64], and 8 when nobody counted."""
    shapes = {"layer1.weight": (1000, 1000), "layer1.bias": (1000,), "head": (10, 1000)}
    placement = Placement(shapes, 3, slice_bytes=1 << 20)
    counted = step_messages(shapes, 3, slice_bytes=1 << 20)
    assert counted == [2 * len(placement.on_server(s)) + CONTROL_MESSAGES for s in range(3)]
    assert sum(counted) == 2 * len(placement.slices) + 3 * CONTROL_MESSAGES
    assert [receive_hwm(n) for n in (None, 1, RECEIVE_HWM + 3, 10**6)] == \
        [RECEIVE_HWM, RECEIVE_HWM, RECEIVE_HWM + 3, MOST_RECEIVE_HWM]
