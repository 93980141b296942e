"""Tier (a) for the cluster tool: theory of the bytes crossing host links, names and
addresses, the launcher's guard.  No namespaces, no processes but a shell."""
import subprocess

import pytest

from allreduce.theory import bytes_sent, host_link_bytes
from experiments.cluster import cli, launch
from experiments.cluster.net import ClusterError, Layout

N = 1 << 24


def test_ring_crosses_each_host_link_once_per_host_not_once_per_rank():
    # 2 hosts x 2 ranks: every rank sends 2(P-1)/P n = 1.5 n, but only ranks 1 and 3
    # have their right neighbour on the other host.
    assert host_link_bytes("ring", N, 2, 2) == [1.5 * N, 1.5 * N]
    assert host_link_bytes("ring", N, 3, 4) == [2 * 11 / 12 * N] * 3
    # one rank a host: every message crosses, as many bytes as a rank sends
    assert host_link_bytes("ring", N, 4, 1) == [bytes_sent("ring", "allreduce", N, 4)] * 4


def test_hierarchical_sends_only_the_leaders_outer_all_reduce_across():
    assert host_link_bytes("hierarchical", N, 2, 2) == [N, N]          # 2 (N-1)/N n, N=2
    assert host_link_bytes("hierarchical", N, 4, 3) == [1.5 * N] * 4
    assert host_link_bytes("hierarchical", N, 2, 4, outer="tree") == [N, N]


def test_halving_doubling_and_tree_across_hosts():
    # pairs at distance 2 cross: n/2 a rank each way, 2 ranks: 2n a host
    assert host_link_bytes("halving_doubling", N, 2, 2) == [2 * N, 2 * N]
    # P = 6 folds to 4: virtual ranks 1, 3, 4, 5; host 2 (ranks 4, 5) pairs across twice
    assert host_link_bytes("halving_doubling", N, 3, 2) == [1.5 * N, 1.5 * N, 2 * N]
    # binomial tree on 4 ranks: edges 1-0, 2-0, 3-2; only 2-0 crosses, up and down
    assert host_link_bytes("tree", N, 2, 2) == [N, N]


def test_one_host_sends_nothing_across_and_libraries_have_no_formula():
    for algo in ("ring", "tree", "halving_doubling", "hierarchical"):
        assert host_link_bytes(algo, N, 1, 4) == [0.0]
    assert host_link_bytes("mpi", N, 2, 2) is None
    assert host_link_bytes("torch", N, 2, 2) is None


def test_layout_names_and_addresses():
    layout = Layout(3, "tl-", "10.77.0.0/24")
    assert [layout.host(i) for i in range(3)] == ["tl-h0", "tl-h1", "tl-h2"]
    assert [layout.address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert (layout.bridge, layout.bridge_address, layout.veth(2)) == ("tl-br", "10.77.0.254",
                                                                      "tl-v2")


@pytest.mark.parametrize("kwargs, words", [
    ({"nodes": 2, "prefix": "TL"}, "prefix"),                 # no '-', uppercase
    ({"nodes": 2, "prefix": "toolong-"}, "prefix"),           # interface names > 15 bytes
    ({"nodes": 2, "subnet": "8.8.8.0/24"}, "private"),        # never a public range
    ({"nodes": 2, "subnet": "10.77.0.0/30"}, "hosts fit"),    # room for 1 host only
    ({"nodes": 0}, "hosts fit"),
])
def test_layout_rejects_bad_names_and_ranges(kwargs, words):
    with pytest.raises(ClusterError, match=words):
        Layout(**kwargs)


def test_latency_goes_to_the_jobs_transport_only_where_netem_is_missing():
    state = {"latency_by": "transport", "inter_latency_us": 50.0}
    assert cli.with_latency(state, ["allreduce.bench"]) == \
        ["allreduce.bench", "--link-latency-us", "50"]
    assert cli.with_latency(state, ["allreduce.bench", "--link-latency-us", "9"]) == \
        ["allreduce.bench", "--link-latency-us", "9"]
    with pytest.raises(ClusterError, match="no netem"):
        cli.with_latency(state, ["psrv.bench"])
    assert cli.with_latency({**state, "latency_by": "netem"}, ["psrv.bench"]) == ["psrv.bench"]


def test_wire_records_go_beside_the_jobs_records():
    assert cli.jsonl_of(["allreduce.bench", "--jsonl", "r.jsonl"]) == "r.jsonl"
    assert cli.jsonl_of(["allreduce.bench", "--jsonl=r.jsonl"]) == "r.jsonl"
    assert cli.jsonl_of(["allreduce.bench"]) is None


def test_launcher_runs_only_on_the_clusters_hosts(tmp_path):
    layout = Layout(2, "tlz-", "10.77.11.0/24")
    _, launcher = launch.write_files(str(tmp_path), layout, 2)
    # hydra's ssh options first, then the host: one that is not ours is refused
    out = subprocess.run(["sh", launcher, "-x", "-o", "BatchMode=yes", "somewhere-else", "true"],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 2 and "not a host of this cluster" in out.stderr
    text = open(launcher).read()
    assert "TOPOLAB_MASTER_ADDR=10.77.11.1" in text and "MPIR_CVAR_CH4_NETMOD=ofi" in text


def test_a_prefix_that_could_match_the_machines_own_links_is_refused_first(tmp_path, monkeypatch,
                                                                           capsys):
    # teardown removes every link whose name starts with the prefix: "e" would take eth0
    monkeypatch.setenv("TOPOLAB_CLUSTER_DIR", str(tmp_path))
    assert cli.main(["status", "--prefix", "e"]) == 2
    assert "prefix 'e' must be 1-5 lowercase letters" in capsys.readouterr().err


def test_a_torn_or_foreign_record_is_named_with_the_way_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOPOLAB_CLUSTER_DIR", str(tmp_path))
    (tmp_path / "tlz-").mkdir()
    for text, words in (('{"nodes": 2}', "lacks ranks_per_node"), ('{"nod', "is unreadable")):
        (tmp_path / "tlz-" / "state.json").write_text(text)
        assert cli.main(["status"]) == 2                # the one cluster recorded: tlz-
        err = capsys.readouterr().err
        assert words in err and "`down --prefix tlz-` removes it" in err
        assert len(err.strip().splitlines()) == 1
