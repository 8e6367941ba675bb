"""Which address a rank gives its peers (course plumbing; `make doctor` prints the same). gloo binds to
the address this host's name resolves to, unless GLOO_SOCKET_IFNAME names an interface (NCCL:
NCCL_SOCKET_IFNAME; Horovod's gloo: HOROVOD_GLOO_IFACE). Two mistakes, each said in one line:
- a variable naming no interface of this node: refused before anything starts (exit 2);
- an address the other nodes cannot reach (most often loopback: a host name that resolves to
  127.0.0.1, the usual laptop and container setup): the job starts, gloo's connections between the
  ranks fail at init_process_group, and the line says which address and what to set.
One node never shows the second: every address there is reachable (diagnose/hangs.md).
"""
import os
import re
import socket

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")


def interfaces():
    """{name: [IPv4 addresses]} of this node (its network namespace)."""
    try:
        import psutil
        return {name: [a.address for a in addrs if a.family == socket.AF_INET]
                for name, addrs in psutil.net_if_addrs().items()}
    except ImportError:  # names only
        return {name: [] for _, name in socket.if_nameindex()}


def listed(found=None):
    """'lo 127.0.0.1; eth0 10.77.0.1'"""
    found = interfaces() if found is None else found
    return "; ".join(f"{name} {','.join(v4)}".strip() for name, v4 in found.items())


def host_address():
    """(this host's name, the address it resolves to, or None)."""
    host = socket.gethostname()
    try:
        return host, socket.gethostbyname(host)
    except OSError:
        return host, None


def is_loopback(address):
    return bool(address) and (address.startswith("127.") or address in ("::1", "localhost"))


def interface_problem(env=None):
    """The line for an interface variable that names no interface of this node, or None. NCCL takes
    prefixes ("eth" matches eth0), "=" for exact names and "^" to exclude; gloo and Horovod exact
    names (gloo: a comma-separated list, each of which must exist)."""
    env = os.environ if env is None else env
    found = None
    for var in VARIABLES:
        value = env.get(var, "").strip()
        if not value or (var == "NCCL_SOCKET_IFNAME" and value.startswith("^")):
            continue
        found = interfaces() if found is None else found
        wanted = [w for w in value.lstrip("=").split(",") if w]
        if var == "NCCL_SOCKET_IFNAME":  # any one of them will do
            prefix = not value.startswith("=")
            missing = [] if any(n == w or (prefix and n.startswith(w)) for n in found for w in wanted) \
                else wanted
        else:
            missing = [w for w in wanted if w not in found]
        if missing:
            return (f"{var}={value} names no interface of this node ({socket.gethostname()}: "
                    f"{listed(found)}): set it to the interface on the network the nodes share, the "
                    "same on every node (`make doctor` lists them; diagnose/hangs.md)")
    return horovod_host_problem(env)


def horovod_host_problem(env):
    """horovodrun --gloo across nodes: Horovod 0.28.1's gloo gives the peers of its main process set the
    address this host's name resolves to, whatever HOROVOD_GLOO_IFACE says (gloo_context.cc's
    InitializeForProcessSet reads an interface it was never given); a name that resolves to loopback
    would end every rank in gloo's abort, a C++ line about 127.0.0.1. The line for it, or None."""
    iface = env.get("HOROVOD_GLOO_IFACE", "").strip()
    if not iface or int(env.get("HOROVOD_CROSS_SIZE", "1") or 1) < 2:  # (not horovodrun's, or one node)
        return None
    host, address = host_address()
    if address and not is_loopback(address):
        return None
    mine = ",".join(interfaces().get(iface, [])) or "its address"
    return (f"Horovod's gloo across nodes gives its peers the address this host's name resolves to, "
            f"whatever HOROVOD_GLOO_IFACE says (Horovod 0.28.1), and {host} resolves to {address} here, "
            f"which no other node reaches: make {host} resolve to this node's address on the network the "
            f"nodes share ({iface} {mine}; /etc/hosts), or run Horovod under mpiexec (diagnose/hangs.md)")


def check_interfaces():
    """Before anything starts: an interface variable naming no interface here is one line, exit 2."""
    if problem := interface_problem():
        from course.errors import fail, record_for_torchrun
        record_for_torchrun(f"error: {problem}")
        fail(problem)


def advertised(env=None):
    """(the address this rank gives its peers over gloo, and why that one)."""
    env = os.environ if env is None else env
    chosen = env.get("GLOO_SOCKET_IFNAME", "").strip()
    if chosen:
        first = chosen.split(",")[0]
        v4 = interfaces().get(first) or []
        return (v4[0] if v4 else None), f"GLOO_SOCKET_IFNAME={chosen}"
    host, address = host_address()
    return address, f"its host name {host} resolves to it"


def unreachable_line(exc, rank):
    """The line for gloo failing to connect the ranks to one another (connectFullMesh), or None: the
    address that could not be reached (a peer's, where gloo names it; this rank's own otherwise) and
    what to set."""
    text = str(exc)
    if "connectFullMesh" not in text:
        return None
    remote = re.search(r"remote=\[([^\]]+)\]", text)
    mine, why = advertised()
    real = "; ".join(f"{name} {','.join(v4)}" for name, v4 in interfaces().items()
                     if v4 and not all(is_loopback(a) for a in v4))
    fix = ("set GLOO_SOCKET_IFNAME to the interface on the network the nodes share, the same on every "
           f"node (this node: {real or listed()}; `make doctor`; diagnose/hangs.md)")
    if remote and is_loopback(remote.group(1)):
        told = f"a peer gave it {remote.group(1)}, a loopback address no other node reaches"
    elif remote:
        told = f"a peer gave it {remote.group(1)}, which this node cannot reach"
    elif is_loopback(mine):
        told = f"this rank gave its peers {mine} ({why}), a loopback address no other node reaches"
    else:
        told = f"this rank gave its peers {mine or 'no address'} ({why}); they could not connect to it"
    return f"rank {rank} could not connect to the other ranks in init_process_group: {told}: {fix}"
