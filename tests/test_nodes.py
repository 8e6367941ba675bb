"""tools/nodes.py: "nodes" as network namespaces joined by a shaped link, made and removed however a run ends, and
a lesson across them through its real launcher (torchrun, one per node) equal to the same job on one node.
Needs root (CAP_NET_ADMIN), as CI and the course's machines run; the tests say so where it is missing."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support import (
    DDP,
    DS,
    EXAMPLES,
    GPT_DDP,
    GPT_FSDP,
    GPT_QUICK,
    GPT_SMALL,
    GPT_SPLIT,
    HVD_TF,
    HVD_TORCH,
    LONG,
    PP,
    QUICK,
    TP,
    check,
    mpiexec,
    run,
    run_together,
    same_training,
    summary,
    warm,
)
from tools import launch, nodes

CP, EP = EXAMPLES["transformer-cp"], EXAMPLES["transformer-ep"]

# Why a skip here hides no broken path: making a network namespace needs root (CAP_NET_ADMIN), which a laptop's
# `make test` may not have. Only the tests that make namespaces carry the mark, and only a missing root skips them;
# under CI (root) they always run, and there not being root fails the file at once. The tests that make no
# namespace (the launcher refused, the bench's rates) run everywhere.
NOT_ROOT = os.geteuid() != 0
if NOT_ROOT and os.environ.get("CI", "").lower() == "true":
    raise RuntimeError("tests/test_nodes.py: CI must run as root (network namespaces need CAP_NET_ADMIN)")
needs_root = pytest.mark.skipif(NOT_ROOT, reason="makes network namespaces, which need root (CAP_NET_ADMIN): a "
                                "user's pytest is in no user namespace of its own (only tools/bench_network.py "
                                "runs itself again in one), so it skips; under CI, not being root fails")

SHORT = ["--epochs", "1", "--max-steps", "8", "--num-threads", "1"]
LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30); n = 0
while (d := c.recv(1 << 16)):
    n += len(d)
print(n)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], 5001), timeout=30) as s:
    s.sendall(b"x" * 1_000_000)
"""


def transfer(names, to_address, connect_address):
    """names[1] listens on `to_address`; names[0] sends 1 MB to `connect_address`. Returns (bytes names[1] got,
    names[0]'s exit code)."""
    listener = subprocess.Popen(nodes.in_node(names[1], [sys.executable, "-c", LISTEN, to_address]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(50):  # until node 1 listens
            if f"{to_address}:5001" in subprocess.run(nodes.in_node(names[1], ["ss", "-ltn"]), capture_output=True,
                                                      text=True, timeout=10).stdout:
                break
            time.sleep(0.1)
        sender = subprocess.run(nodes.in_node(names[0], [sys.executable, "-c", SEND, connect_address]),
                                capture_output=True, text=True, timeout=60)
        if sender.returncode != 0:
            listener.kill()
        out, _ = listener.communicate(timeout=60)
        return int(out.strip() or 0), sender.returncode
    finally:
        listener.kill()


# Run as a user who is not root (nobody): the nodes, their shaped link and 1 MB across it, in a user namespace.
AS_A_USER = f"""
import subprocess, sys, time
sys.path.append({str(nodes.__file__.rsplit("/tools/", 1)[0])!r})
from tools import nodes
nodes.as_root_of_a_user_namespace(sys.argv)
with nodes.nodes(2, "200mbit") as names:
    print(subprocess.run(nodes.in_node(names[0], ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True,
                         text=True).stdout.strip())
    listener = subprocess.Popen(nodes.in_node(names[1], [sys.executable, "-c", {LISTEN!r}, "10.77.0.2"]),
                                stdout=subprocess.PIPE, text=True)
    for _ in range(50):
        if "10.77.0.2:5001" in subprocess.run(nodes.in_node(names[1], ["ss", "-ltn"]), capture_output=True,
                                              text=True).stdout:
            break
        time.sleep(0.1)
    subprocess.run(nodes.in_node(names[0], [sys.executable, "-c", {SEND!r}, "10.77.0.2"]), timeout=60)
    print("received", listener.communicate(timeout=60)[0].strip())
"""


@needs_root  # (to become another user)
def test_a_user_who_is_not_root_makes_the_nodes_in_a_user_namespace_of_its_own():
    """tools/bench_network.py on a laptop without sudo: not root, it runs again as root of a user namespace of its
    own, where it makes the nodes, shapes their link and sends across it; nothing is left behind outside."""
    folder = tempfile.mkdtemp(dir="/tmp")  # (a folder the user nobody can read: pytest's are root's alone)
    try:
        os.chmod(folder, 0o755)
        probe = Path(folder) / "probe.py"
        probe.write_text(AS_A_USER)
        probe.chmod(0o644)
        # (the system's python: the venv's links to an interpreter under /root, which nobody may not reach;
        # tools/nodes.py needs nothing but the standard library)
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 probe], capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("nodes: not root: in a user namespace"), lines
    assert "tbf" in lines[1] and "200Mbit" in lines[1] and lines[-1] == "received 1000000", lines
    assert not [n for n in nodes.namespaces() if n.startswith(f"{nodes.PREFIX}p")], nodes.namespaces()  # (its own)


@needs_root
def test_nodes_are_namespaces_joined_by_a_shaped_link_and_go_away():
    with nodes.nodes(2, "200mbit", own_hosts=True) as names:
        tag = names[0].rsplit("-", 1)[0]
        assert sorted(nodes.namespaces(tag.removeprefix(nodes.PREFIX))) == sorted([*names, f"{tag}-switch"])
        before = nodes.link_bytes(names)
        assert transfer(names, "10.77.0.2", "10.77.0.2") == (1_000_000, 0)  # over eth0, node to node
        crossed = nodes.link_bytes(names) - before  # (what tools/bench_network.py counts per step)
        assert 1_000_000 <= crossed <= 1_100_000, crossed  # the payload, TCP/IP's headers and acknowledgements
        qdisc = subprocess.run(nodes.in_node(names[0], ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True,
                               text=True, timeout=10).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc  # the link's rate, as tc holds it
        # node 1's loopback is its own: node 0 cannot reach what listens there (the link is the only way)
        assert transfer(names, "127.0.0.1", "127.0.0.1")[1] != 0
        for node, name in enumerate(names):  # the machine's name is the node's address there, as on a cluster
            resolved = subprocess.run(nodes.in_node(name, ["getent", "hosts", socket.gethostname()]),
                                      capture_output=True, text=True, timeout=10).stdout.split()
            assert resolved[:1] == [nodes.address(node)], resolved
    assert nodes.namespaces(tag.removeprefix(nodes.PREFIX)) == []
    assert not [name for name in names if os.path.exists(os.path.join(nodes.ETC, name))]  # their /etc/hosts too


@needs_root
def test_four_nodes_share_one_switch_and_each_reaches_every_other():
    """4 nodes: each node's eth0 is a port of the one switch, so node 0 reaches node 3, node 3 node 0 and node 2
    node 1 directly; all of them go away."""
    with nodes.nodes(4, "1gbit") as names:
        tag = names[0].rsplit("-", 1)[0]
        assert sorted(nodes.namespaces(tag.removeprefix(nodes.PREFIX))) == sorted([*names, f"{tag}-switch"])
        for sender, receiver in ((0, 3), (3, 0), (2, 1)):
            assert transfer([names[sender], names[receiver]], nodes.address(receiver),
                            nodes.address(receiver)) == (1_000_000, 0), (sender, receiver)
    assert nodes.namespaces(tag.removeprefix(nodes.PREFIX)) == []


CONNECT = """
import socket, sys, time
for _ in range(600):  # until node 1 listens; then one handshake, timed: a round trip
    t = time.monotonic()
    try:
        socket.create_connection((sys.argv[1], 5001), timeout=30).close()
        print(time.monotonic() - t)
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
"""


def kernel_has_netem():
    """Asked of the kernel itself, not of tools/nodes.py: a netem qdisc on a scratch namespace's loopback."""
    return subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root netem delay "
                           "1ms"], capture_output=True, timeout=30).returncode == 0


@needs_root
def test_a_delay_is_added_where_the_kernel_has_netem_and_refused_in_one_line_where_not():
    """--delay 50ms: where the kernel has netem, what each node sends waits 50 ms, so a connection's handshake (one
    round trip) takes at least 100 ms; where it has none (this course's machines: only that branch has run), one
    line says so, and no node is left."""
    mine = f"p{os.getpid()}"
    if not kernel_has_netem():
        with pytest.raises(SystemExit) as refused, nodes.nodes(2, "1gbit", delay="50ms"):
            pass
        assert str(refused.value) == ("error: nodes: --delay 50ms: this kernel has no netem qdisc (the module "
                                      "sch_netem), so no delay can be added here; only --rate shapes the link")
        assert not nodes.namespaces(mine)
        return
    with nodes.nodes(2, "1gbit", delay="50ms") as names:
        listener = subprocess.Popen(nodes.in_node(names[1], [sys.executable, "-c", LISTEN, nodes.address(1)]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            took = subprocess.run(nodes.in_node(names[0], [sys.executable, "-c", CONNECT, nodes.address(1)]),
                                  capture_output=True, text=True, timeout=60)
        finally:
            listener.wait(timeout=60)
    assert took.returncode == 0 and float(took.stdout) >= 0.1, (took.stdout, took.stderr)


@needs_root
def test_nodes_go_away_when_the_block_fails():
    with pytest.raises(RuntimeError, match="a failed run"):
        with nodes.nodes(2) as names:
            assert len(names) == 2
            raise RuntimeError("a failed run")
    assert not [n for n in nodes.namespaces() if n.startswith(f"{nodes.PREFIX}p{os.getpid()}-")]


# (script, launcher across the nodes, launcher of the lesson's own tests' run on one node, the one compared with).
# `make test` crosses the nodes once under each launcher (torchrun: DDP at 2 x 2, below); `make test-all` all rows.
ACROSS = [(DDP, "torchrun", "torchrun"), (DDP, "mpiexec", "torchrun"), (HVD_TORCH, "mpiexec", "horovodrun"),
          (HVD_TORCH, "horovodrun", "horovodrun"), (DS, "torchrun", "torchrun"), (DS, "deepspeed", "torchrun"),
          (GPT_DDP, "torchrun", "torchrun"), (GPT_FSDP, "torchrun", "torchrun"), (TP, "torchrun", "torchrun"),
          (CP, "torchrun", "torchrun"), (EP, "torchrun", "torchrun"), (PP, "torchrun", "torchrun"),
          (HVD_TF, "horovodrun", "horovodrun")]
IN_MAKE_TEST = {(HVD_TORCH, "mpiexec"), (HVD_TORCH, "horovodrun"), (DS, "deepspeed")}


@needs_root
@pytest.mark.parametrize("script, launcher, one_node_launcher", [
    pytest.param(*row, id=f"{row[0]}-{row[1]}", marks=[] if row[:2] in IN_MAKE_TEST else [LONG]) for row in ACROSS])
def test_every_lesson_on_two_nodes_over_a_link_equals_one_node(shared_run, tmp_path, script, launcher,
                                                                one_node_launcher):
    """2 nodes x 1 rank, each node a namespace, the lesson's real launcher across them (torchrun: one per node;
    mpiexec: one, its proxies started in each node through tools/node_rsh.sh; horovodrun: one, reaching node 1
    through tools/node_ssh/ssh; the deepspeed launcher: one, its MPICH runner's proxies through node_rsh.sh), gloo
    (Horovod under mpiexec: MPI) over the shaped link: the same training as the 2-rank run on one node, digit for
    digit."""
    flags = {DS: [*QUICK, "--zero-stage", "3"], GPT_DDP: GPT_QUICK, GPT_FSDP: GPT_QUICK, TP: GPT_SPLIT,
             CP: GPT_SPLIT, EP: GPT_SPLIT, PP: GPT_SPLIT, HVD_TF: [*QUICK, "--dropout", "0"]}.get(script, QUICK)
    one, _ = shared_run(script, one_node_launcher, flags)
    with nodes.nodes(2, "1gbit", own_hosts=launcher == "horovodrun") as names:  # (test_horovods_gloo_...)
        ran = run_together(launch.nodes_over_a_network(script, names, 1, [*flags, "--log-all-ranks", "--log-dir",
                                                                           tmp_path / "two"], launcher=launcher),
                           timeout=300)
    assert all(code == 0 for code, _, _ in ran), [err[-2000:] for _, _, err in ran]
    every = "".join(out for _, out, _ in ran)
    assert "[rank 0, local 0]" in every and "[rank 1, local 0]" in every  # one rank per node: local 0 on both
    assert "[rank 1, local 1]" not in every
    same_training(one, tmp_path / "two")


@needs_root
def test_ddp_on_two_nodes_of_two_ranks_numbers_ranks_globally_and_equals_one_node(tmp_path):
    """2 nodes x 2 ranks over the link: each node's torchrun starts local ranks 0 and 1, the rendezvous gives node 0
    global ranks 0-1 and node 1 ranks 2-3, and the training equals 4 ranks on one node."""
    flags = [*SHORT, "--log-all-ranks"]
    check(run(warm(4, DDP, *flags, "--log-dir", tmp_path / "one"), timeout=240))  # (the nodes: torchrun)
    with nodes.nodes(2, "1gbit") as names:
        ran = run_together(launch.nodes_over_a_network(DDP, names, 2, [*flags, "--log-dir", tmp_path / "two"]),
                           timeout=300)
    assert [code for code, _, _ in ran] == [0, 0], [err[-2000:] for _, _, err in ran]
    seen = [tuple(sorted(int(line.split()[1].rstrip(",")) for line in out.splitlines()
                         if line.startswith("[rank ") and "pytorch-ddp:" in line)) for _, out, _ in ran]
    assert seen == [(0, 1), (2, 3)]  # node 0's, node 1's
    every = "".join(out for _, out, _ in ran)
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"[rank {rank}, local {local}] pytorch-ddp: 4 rank(s) via torchrun" in every
    assert summary(tmp_path / "two")["world_size"] == 4
    same_training(tmp_path / "one", tmp_path / "two")


# The lessons beyond DDP at 2 nodes x 2 ranks (make test-all): (script, launcher across the nodes, flags)
TWO_BY_TWO = [(GPT_FSDP, "torchrun", [*GPT_SMALL, "--epochs", "1", "--max-steps", "4", "--batch-size", "2",
                                      "--replicate", "2", "--save-model"]),  # HSDP: a shard group in each node
              (TP, "torchrun", [*GPT_SPLIT, "--heads", "4"]), (GPT_DDP, "torchrun", GPT_QUICK),
              (CP, "torchrun", GPT_SPLIT), (EP, "torchrun", GPT_SPLIT),  # (4 experts, one a rank)
              (PP, "torchrun", [*GPT_SPLIT, "--layers", "4"]),  # (a stage a rank)
              (HVD_TORCH, "horovodrun", SHORT),
              (HVD_TORCH, "mpiexec", SHORT),
              (HVD_TF, "horovodrun", [*SHORT, "--dropout", "0"]), (DS, "deepspeed", [*SHORT, "--zero-stage", "3"])]


@LONG
@needs_root
@pytest.mark.parametrize("script, launcher, flags", TWO_BY_TWO, ids=[f"{s}-{n}" for s, n, _ in TWO_BY_TWO])
def test_the_other_lessons_on_two_nodes_of_two_ranks_equal_four_ranks_on_one_node(tmp_path, script, launcher, flags,
                                                                                  monkeypatch):
    """2 nodes x 2 ranks through the lesson's real launcher across the link (Horovod TensorFlow included): global
    ranks 0-3, two on each node, and the training of 4 ranks on one node (warm: the launcher's claim is the
    nodes' run; Horovod over MPI: under mpiexec there too, MPI's sums being its own), digit for digit. HSDP's
    shard groups lie inside the nodes and its copies across the link; tensor parallelism splits over all 4.
    Horovod without tensor fusion: with it, which gradients share a buffer depends on the moment each is ready,
    so from 3 ranks on a ring sums each number in another order, and two 4-rank runs on one node already differ
    in the 7th digit (2026-12-06: 2.1805478, 2.1805517, 2.1805478; with HOROVOD_FUSION_THRESHOLD=0, three equal)."""
    flags = [*flags, "--log-all-ranks"]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")  # (read by Horovod alone: the other lessons ignore it)
    one = [*flags, "--log-dir", tmp_path / "one"]
    if launcher == "mpiexec":  # (MPI's sums are its own)
        check(run(mpiexec(4, script, *one), timeout=300))
    else:
        check(run(warm(4, script, *one, launcher=launcher if launcher == "horovodrun" else None), timeout=300))
    with nodes.nodes(2, "1gbit", own_hosts=launcher == "horovodrun") as names:
        ran = run_together(launch.nodes_over_a_network(script, names, 2, [*flags, "--log-dir", tmp_path / "two"],
                                                       launcher=launcher), timeout=400)
    assert all(code == 0 for code, _, _ in ran), [(out + err)[-3000:] for _, out, err in ran]
    every = "".join(out + err for _, out, err in ran)
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"[rank {rank}, local {local}]" in every, every[-3000:]
    assert summary(tmp_path / "two")["world_size"] == 4
    same_training(tmp_path / "one", tmp_path / "two")


def test_nodes_over_a_network_refuses_a_launcher_that_cannot_do_it():
    with pytest.raises(ValueError, match="torchrun, mpiexec, horovodrun or deepspeed"):
        launch.nodes_over_a_network(DDP, ["course-x-node0", "course-x-node1"], 1, launcher="srun")


@needs_root
def test_an_interface_the_other_node_cannot_reach_is_one_line_on_every_rank(tmp_path):
    """GLOO_SOCKET_IFNAME naming loopback (or, unset, a host name that resolves to 127.0.0.1) across nodes: each rank
    tells its peers 127.0.0.1, which no other node reaches. Every rank ends in one line that says which address and
    what to set, naming its node's own interface, instead of a hang (node 1 waits 5 x --dist-timeout: gloo's
    connect)."""
    with nodes.nodes(2) as names:
        ran = run_together(launch.nodes_over_a_network(DDP, names, 1, [*QUICK, "--dist-timeout", "5", "--log-dir",
                                                                        tmp_path / "run"], interface="lo"),
                           timeout=240)
    assert [code for code, _, _ in ran] == [1, 1], [err[-2000:] for _, _, err in ran]
    for node, (_, out, err) in enumerate(ran):
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, err[-3000:]
        assert f"rank {node} could not connect to the other ranks in init_process_group" in lines[0], lines
        assert "127.0.0.1" in lines[0] and "loopback" in lines[0], lines
        assert "set GLOO_SOCKET_IFNAME to the interface on the network the nodes share" in lines[0], lines
        assert f"this node: eth0 {nodes.address(node)}" in lines[0], lines
        assert not re.search(r'File "[^"]*DDP/main\.py"', err), err[-3000:]  # no traceback through the lesson


@needs_root
def test_mpiexec_told_an_interface_the_other_node_cannot_reach_stops_before_any_rank_starts(tmp_path):
    """MPI's equivalent of GLOO_SOCKET_IFNAME is the launcher's `-iface`: given loopback across the nodes, Hydra
    cannot reach node 1's proxy and stops in its own words (diagnose/hangs.md), non-zero, before any rank
    starts: no hang, no run folder."""
    with nodes.nodes(2) as names:
        ran = run_together(launch.nodes_over_a_network(DDP, names, 1, [*QUICK, "--log-dir", tmp_path / "run"],
                                                       launcher="mpiexec", interface="lo"), timeout=120)
    (code, out, err), = ran
    assert code != 0 and "Launch proxy failed" in out + err, (out + err)[-3000:]
    assert "unable to connect to server 127.0.0.1" in out + err  # node 1's proxy, told loopback
    assert not (tmp_path / "run").exists()


@needs_root
def test_horovods_gloo_across_nodes_whose_host_name_is_loopback_is_one_line_on_every_rank(tmp_path):
    """horovodrun --gloo across the nodes, whose host name resolves to 127.0.0.1 (no node has a /etc/hosts of its
    own): Horovod 0.28.1 gives its main process set's peers that address whatever --network-interface says, and
    every rank would die in gloo's C++ abort ("connect [127.0.0.1]:N: Connection refused"). Each rank says so in
    one line instead, before hvd.init, naming its interface's address; with the nodes' own /etc/hosts the same
    launch trains (test_every_lesson_on_two_nodes_over_a_link_equals_one_node)."""
    with nodes.nodes(2) as names:
        ran = run_together(launch.nodes_over_a_network(HVD_TORCH, names, 1, [*QUICK, "--log-dir", tmp_path / "run"],
                                                       launcher="horovodrun"), timeout=240)
    (code, out, err), = ran
    assert code != 0, out[-2000:]
    for rank in (0, 1):
        lines = [line for line in (out + err).splitlines() if line.startswith(f"[{rank}]<stderr>:error: ")]
        assert len(lines) == 1, (out + err)[-3000:]
        assert "resolves to 127.0.0.1 here" in lines[0] and f"(eth0 {nodes.address(rank)}; /etc/hosts)" in lines[0]
    assert "gloo::IoException" not in out + err


ENV_AND_ADDRESS = """import json, os, socket, sys
rank = os.environ["RANK"]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((os.environ["MASTER_ADDR"], 9))  # (no packet: the route alone picks this node's own address)
with open(os.path.join(sys.argv[1], "env." + rank), "w") as f:
    json.dump({"env": dict(os.environ), "address": s.getsockname()[0]}, f)
"""


@needs_root
def test_warm_ranks_on_the_nodes_are_in_their_node_with_the_variables_torchrun_gives_there(tmp_path):
    """tests/warm.py across the nodes (`warm(4, script, nodes=names)`, which the ring fit's test below uses): each
    rank in its node's namespace (its socket's address is its node's eth0), with the variables `torchrun --nnodes 2
    --nproc_per_node 2` gives its workers there, less the agent's store and error file and the port's number."""
    script = tmp_path / "env.py"
    script.write_text(ENV_AND_ADDRESS)
    dump = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    # what a plain child of this process has (run_together's: the C library's environment, which a library may
    # have added to behind os.environ's back), and of support.run (its own few variables)
    plain, of_run = json.loads(subprocess.check_output(dump, text=True)), json.loads(run(dump).stdout)

    def seen(folder, own):
        ranks = [json.loads(path.read_text()) for path in sorted(folder.glob("env.*"))]
        assert len(ranks) == 4, ranks
        return [({k: v for k, v in r["env"].items() if own.get(k) != v and k not in ("MASTER_PORT", "_")},
                 r["address"]) for r in ranks]

    (tmp_path / "launched").mkdir()
    (tmp_path / "warm").mkdir()
    with nodes.nodes(2) as names:
        ran = run_together(launch.nodes_over_a_network(script, names, 2, [tmp_path / "launched"]), timeout=120)
        assert [code for code, _, _ in ran] == [0, 0], [err[-2000:] for _, _, err in ran]
        check(run(warm(4, script, tmp_path / "warm", nodes=names), timeout=120))
    launched = seen(tmp_path / "launched", plain)
    for env, _ in launched:
        assert env.pop("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.pop("TORCHELASTIC_ERROR_FILE")
    assert [address for _, address in launched] == [nodes.address(n) for n in (0, 0, 1, 1)]
    assert seen(tmp_path / "warm", of_run) == launched


@needs_root
def test_the_ring_fit_recovers_the_shaped_link_rate(tmp_path):
    """diagnose/collectives.py across two nodes whose links tc holds to 500 Mbit/s: the ring fit's beta is the link's
    rate within 20% (62.5 MB/s; a 2-rank ring all-reduce sends each rank's whole buffer once over its link). Sizes
    from 1 MB, well above the token bucket's 256 KB burst, which lets a small message through unshaped; the fit's
    alpha is the stack's own cost, which tools/bench.py --network measures on an unshaped link."""
    with nodes.nodes(2, "500mbit") as names:  # (warm ranks, one in each node: the claim is the link's)
        check(run(warm(2, "diagnose/collectives.py", "--ops", "all_reduce", "--min-size", "1M", "--max-size", "4M",
                       "--repeats", "3", "--out", tmp_path, nodes=names), timeout=300))
    beta = json.loads((tmp_path / "collectives.json").read_text())["fit"]["beta_Bps"]
    assert 0.8 * 62.5e6 <= beta <= 1.2 * 62.5e6, f"beta {beta / 1e6:.1f} MB/s against the link's 62.5 MB/s"


def test_the_network_bench_takes_rates_as_tc_writes_them_and_refuses_others():
    """tools/bench_network.py (make bench): tc's units are 1000-based bits per second; a rate tc would not
    take is one line and exit 2, before any namespace is made."""
    from tools import bench_network
    assert bench_network.bytes_per_s("500mbit") == 62.5e6 and bench_network.bytes_per_s("1gbit") == 125e6
    for flag in ("--rates", "--sharded-rates"):
        bad = subprocess.run([sys.executable, "tools/bench_network.py", flag, "1gbit", "5parsec"], cwd=launch.ROOT,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
            "5parsec: a rate as tc writes it (200mbit, 1gbit)"), bad.stderr
