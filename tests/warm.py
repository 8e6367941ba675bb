"""Ranks started warm: a lesson's processes forked from an interpreter that has already imported torch.

A rank started from cold spends seconds before it trains: `import torch`, then its first optimizer step imports
`torch._dynamo` (tools/PERFORMANCE.md, "what the launches alone cost"). Most tests start ranks to check what the
ranks do (N ranks equal one process, a checkpoint continues, a bad value is refused), not how a launcher starts
them. Those tests start them here: one server per test process (a fresh interpreter, `python tests/warm.py`)
imports torch and takes one optimizer step, then forks a child per rank. The child is a real process (its own pid,
exit code, signals, stdout, stderr and files) that runs the lesson file as `__main__` with the launcher's
environment (tools/launch.py `torchrun_worker_env`, or `horovodrun_worker_env` with horovodrun's rendezvous server
in the test's process) and its argv. A TensorFlow lesson's ranks fork from a server of their own. The lesson cannot
tell, except that its framework was already imported. Why a server of our own and not multiprocessing's forkserver:
a forkserver child is a multiprocessing worker (its stdio, signals and exit code are the pool's, and it returns to
the pool); ours must be `python lesson.py` in every way a test can see. It forks with no thread in the server but
OpenBLAS's (checked before each fork; OpenBLAS stops its pool around a fork): no process group, no OpenMP pool.
Which tests start warm, and which keep their launcher: tests/README.md.

    run(warm(2, "DDP/main.py", "--epochs", "1"))     # as run(torchrun(2, ...)): a CompletedProcess
"""
import ast
import functools
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class WarmCommand(list):
    """What warm() returns: the command as a list to print, with what the server needs."""

    def __init__(self, nproc, script, args, launcher, nodes=(), interface="eth0"):
        self.nproc, self.script, self.args = nproc, str(ROOT / script), [str(a) for a in args]
        self.launcher, self.nodes, self.interface = launcher, list(nodes), interface
        super().__init__(["warm", "-n", str(nproc), *(["--as", launcher] if launcher else []),
                          *(["--nodes", ",".join(self.nodes)] if nodes else []), self.script, *self.args])


def warm(nproc, script, *args, launcher=None, nodes=(), interface="eth0"):
    """`script` on `nproc` ranks forked warm: 1 is `python script`, more are torchrun's workers on one node;
    launcher="horovodrun": `horovodrun --gloo`'s ranks (any number), their rendezvous server in this process.
    nodes: the network namespaces tools/nodes.py made, nproc / len(nodes) ranks in each, as `torchrun --nnodes`
    starts them there with GLOO_SOCKET_IFNAME=`interface` (tools/launch.py nodes_over_a_network)."""
    if launcher not in (None, "horovodrun"):
        raise ValueError(f"warm ranks start as torchrun's (the default) or horovodrun's, not {launcher!r}")
    if nodes and launcher:
        raise ValueError(f"warm ranks across nodes start as torchrun's, not {launcher!r}")
    if nodes and nproc % len(nodes):
        raise ValueError(f"warm ranks across nodes: the same number on each node, not {nproc} on {len(nodes)}")
    return WarmCommand(nproc, script, args, launcher, nodes, interface)


# ---- the client: in the test's process ------------------------------------------------------------------------

_servers = {}  # _kind's (what it preloaded: "torch" or "tensorflow", the variables set before, modules) -> it


def _the_server(kind):
    server = _servers.get(kind)
    if server is None or server.poll() is not None:
        folder = Path(tempfile.mkdtemp(prefix="warm-"))
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
        env.update(kind[1])  # (what the lesson sets before its first import: its imports read them)
        with open(folder / "stderr", "w") as err:  # (TensorFlow's import talks: kept for a server that fails)
            server = subprocess.Popen([sys.executable, __file__, str(folder / "socket"), kind[0], *kind[2]],
                                      env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=err, text=True, start_new_session=True)
        ready = server.stdout.readline()
        if not ready.startswith("ready "):
            raise RuntimeError(f"the warm server did not start: {ready!r}\n{(folder / 'stderr').read_text()}")
        server.socket_path = ready.split(" ", 1)[1].strip()
        _servers[kind] = server
    return server


def _imported(node):
    """The modules a statement imports, by absolute name (none for any other statement)."""
    return [a.name for a in node.names] if isinstance(node, ast.Import) else \
        [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []


def top_level_imports(script):
    """The modules a lesson imports at its top level, by absolute name."""
    return [name for node in ast.parse(Path(script).read_text()).body for name in _imported(node)]


def preamble(script):
    """(variables, modules): what a process that imports a lesson's modules ahead of it (a warm server,
    tests/rows.py) may set and import first, as the lesson itself would. The variables it sets at its top level
    (`os.environ["NAME"] = "value"`: keras_main.py's TF_USE_LEGACY_KERAS, which TensorFlow reads as it is imported),
    and its top-level imports up to its first `sys.modules[...] = ...` (keras_main.py makes `keras` mean tf_keras
    before it imports Horovod's Keras module, which binds `keras` as it is imported)."""
    variables, names = {}, []
    for node in ast.parse(Path(script).read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
            break
        if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ" and \
                isinstance(target.slice, ast.Constant) and isinstance(node.value, ast.Constant):
            variables[target.slice.value] = node.value.value
        names += _imported(node)
    return variables, names


TENSORFLOW = ("tensorflow", "tf_keras", "keras", "horovod.tensorflow", "horovod.tensorflow.keras")  # (preloaded)


@functools.lru_cache(maxsize=None)
def _kind(script):
    """The server a lesson's ranks fork from: (kind, variables, modules). TensorFlow's for a lesson that imports
    it at its top level (a process that has imported torch and its optimizer's triton must not load TensorFlow:
    tests/conftest.py), with the variables the lesson sets first and those of its TensorFlow, Keras and Horovod
    imports that preamble() allows, in its order; torch's for every other. Read once per lesson file."""
    variables, names = preamble(script)
    if not any(n.split(".")[0] == "tensorflow" for n in top_level_imports(script)):
        return "torch", tuple(sorted(variables.items())), ()
    return "tensorflow", tuple(sorted(variables.items())), tuple(n for n in names if n in TENSORFLOW)


def _start(argv, env, cwd, stdout, stderr, netns=None):
    """One child: (pid, a socket that will carry its exit status)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_the_server(_kind(argv[0])).socket_path)
    request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "netns": netns}).encode()
    with open(os.devnull) as stdin:
        socket.send_fds(conn, [request], [stdin.fileno(), stdout, stderr])
    return _number(conn, "pid", "before the child started"), conn


def _status(conn):
    """The child's exit status as Popen gives it (negative: killed by that signal), once it has ended."""
    code = _number(conn, "exit", "before the child ended")
    conn.close()
    return code


def _number(conn, word, when):
    """The number of the server's next line `WORD N`, read a byte at a time: the line after it (a quick
    child's exit, after its pid) stays in the socket for select() and the next read."""
    line = b""
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise RuntimeError(f"the warm server went away {when}")
        line += byte
    said, number = line.split()
    assert said == word.encode(), line
    return int(number)


def run_warm(cmd, timeout, env, cwd):
    """Run a WarmCommand as support.run runs a command: (returncode, stdout, stderr, timed out). The return code
    is the first failing rank's (in rank order), as the rank itself ended; 0 if all ended with 0."""
    from course.ranks import free_port
    port, rendezvous = free_port(), None
    if cmd.launcher == "horovodrun":  # the key-value store horovodrun --gloo serves its ranks, as it starts it
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        rendezvous = RendezvousServer(verbose=0)
        port = rendezvous.start()
        rendezvous.init(get_host_assignments(parse_hosts(f"localhost:{cmd.nproc}"), cmd.nproc))
    try:
        return _run_ranks(cmd, timeout, env, cwd, port)
    finally:
        if rendezvous:
            rendezvous.stop()


def _run_ranks(cmd, timeout, env, cwd, port):
    from tools.launch import horovodrun_worker_env, torchrun_worker_env
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    children = []
    try:
        for rank in range(cmd.nproc):
            rank_env = dict(env)
            if cmd.launcher == "horovodrun":
                rank_env.update(horovodrun_worker_env(rank, cmd.nproc, port))
            elif cmd.nproc > 1 or cmd.nodes:
                launcher_env = torchrun_worker_env(rank, cmd.nproc, port, *_across(cmd.nodes))
                if "OMP_NUM_THREADS" in env:  # torchrun sets it only where the user did not
                    launcher_env.pop("OMP_NUM_THREADS", None)
                rank_env.update(launcher_env)
            if cmd.nodes:  # (set for each node's torchrun, as a job script sets it: its workers inherit it)
                rank_env["GLOO_SOCKET_IFNAME"] = cmd.interface
            node = cmd.nodes[rank * len(cmd.nodes) // cmd.nproc] if cmd.nodes else None
            children.append(_start([cmd.script, *cmd.args], rank_env, cwd, out_w, err_w, node))
    finally:
        os.close(out_w)
        os.close(err_w)
    out, err = [], []
    readers = [threading.Thread(target=_drain, args=(fd, into), daemon=True)
               for fd, into in ((out_r, out), (err_r, err))]
    for reader in readers:
        reader.start()
    deadline, codes, timed_out = time.monotonic() + timeout, {}, False
    while len(codes) < len(children):
        left = [conn for pid, conn in children if pid not in codes]
        ready, _, _ = select.select(left, [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            codes.update({pid: _status(conn) for pid, conn in children if conn in ready})
        elif timed_out:  # killed 30 s ago and still not reaped: give up on them
            break
        else:
            timed_out, deadline = True, time.monotonic() + 30
            for pid, _ in children:
                if pid not in codes:
                    _kill_group(pid)
    for reader in readers:
        reader.join(timeout=30)
    failing = [codes[pid] for pid, _ in children if codes.get(pid)]
    return (failing[0] if failing else 0), "".join(out), "".join(err), timed_out


def _across(names):
    """torchrun_worker_env's nodes and node 0's address, for ranks on the nodes `names` (or on this host)."""
    if not names:
        return ()
    from tools import nodes
    return len(names), nodes.address(0)


def _drain(fd, into):
    with open(fd, "rb") as f:
        for chunk in iter(lambda: f.read1(65536), b""):
            into.append(chunk.decode("utf-8", "replace"))


def _kill_group(pid):
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


# ---- the server: `python tests/warm.py SOCKET` -----------------------------------------------------------------

def _preload():
    """What every rank of a PyTorch lesson imports first, and its first optimizer step (torch._dynamo). Returns
    the threads numpy's OpenBLAS started (its pool: OpenBLAS stops it before a fork, pthread_atfork, and the child
    starts its own); anything after that would be copied half-alive into the child."""
    import numpy  # noqa: F401
    openblas = _threads()
    import torch
    import torch.distributed
    import torch.nn.functional
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return openblas


def _preload_tensorflow(modules):
    """What a Horovod TensorFlow lesson imports first (_kind: TensorFlow, Keras, Horovod's TensorFlow ops), in its
    order. An import starts no thread of TensorFlow's runtime (that starts with the first operation, in the child)."""
    import importlib

    import numpy  # noqa: F401
    openblas = _threads()
    for name in modules:
        importlib.import_module(name)
    return openblas


def _threads():
    return len(os.listdir("/proc/self/task"))


def serve(socket_path, kind="torch", *modules):
    threads = _preload_tensorflow(modules) if kind == "tensorflow" else _preload()
    if _threads() > threads:
        raise SystemExit(f"warm server: {_threads() - threads} threads started by torch; a fork would copy them"
                         " half-alive")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print(f"ready {socket_path}", flush=True)
    parent = os.getppid()
    waiting = {}  # pid -> the connection that gets its exit status
    while os.getppid() == parent:  # the test process that started us is gone: so are we
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            if _threads() > threads:
                raise SystemExit("warm server: a thread started; no more forks")
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            conn = waiting.pop(pid, None)
            if conn:
                try:
                    conn.sendall(f"exit {code}\n".encode())
                except OSError:
                    pass
                conn.close()


def _enter_node(name):
    """Move this process into the network namespace `name` (tools/nodes.py's node, at /run/netns/NAME), as `ip
    netns exec NAME` does before it runs a command: from here on its sockets are that node's (its eth0, its
    loopback). Python 3.12 has os.setns; 3.11 calls the C library's."""
    CLONE_NEWNET = 0x40000000
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        if hasattr(os, "setns"):
            os.setns(fd, CLONE_NEWNET)
        else:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        os.close(fd)
    except OSError as e:
        os.write(2, f"warm: cannot enter node {name}: {e}\n".encode())
        os._exit(1)


def _child(request, fds):
    """Become `python SCRIPT ARGS...` with the request's environment and working directory, then end as Python
    ends: the exit handlers run, the output is flushed, the exit code is the script's."""
    os.setsid()  # a process group of its own, as a launcher's worker has
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("netns"):
        _enter_node(request["netns"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else
                                                   io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                                   write_through=True)
    if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:  # read by torch at its import: apply it here
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script` starts: its folder, then PYTHONPATH
    extra = [folder for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep) if folder]
    sys.path[1:1] = extra
    if any((Path(folder) / "sitecustomize.py").exists() for folder in extra):  # (tests/hooks: faults)
        sys.modules.pop("sitecustomize", None)
        import sitecustomize  # noqa: F401
    code = 0
    try:
        import runpy
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:  # as Python ends on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(*sys.argv[1:])
