"""Where the cores go: CPU time of each rank's threads, from /proc (Linux), sampled while a bench run trains.

On 2 cores, 2 ranks leave no core to spare: any thread besides a rank's compute takes its time from a compute
thread. Each run's ranks are sampled when epoch 1 (warm-up) has been logged and again when the last epoch
has: CPU seconds per second of wall time (cores) of the main thread, TensorFlow's op pool ("tf_*" threads:
TF runs kernels there, not on the main thread) and every other thread (Horovod's background thread, gloo's
and MPI's threads, tf.data's), averaged over the ranks.
"""
import os
import threading
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_kind(pid, tid, comm):
    if tid == pid:
        return "main"
    return "tf_pool" if comm.startswith("tf_") else "other"


def cpu_by_kind(before, after, seconds, ticks_per_s=CLOCK_TICKS):
    """Cores used per thread kind, averaged over ranks. before/after: {pid: {tid: (comm, ticks)}} sampled
    `seconds` apart; threads that started in between count from zero, ranks gone by `after` are left out."""
    ranks = [pid for pid in before if pid in after]
    if not ranks or seconds <= 0:
        return None
    cores = {"main": 0.0, "tf_pool": 0.0, "other": 0.0}
    for pid in ranks:
        for tid, (comm, ticks) in after[pid].items():
            used = ticks - before[pid].get(tid, (comm, 0))[1]
            cores[thread_kind(pid, tid, comm)] += used / ticks_per_s / seconds / len(ranks)
    cores["total"] = sum(cores.values())
    return cores


def rank_pids(script, log_dir):
    """The example's processes (python <script> ... <log_dir>), not the launchers around them."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a and a != b"-u"]
        if len(argv) > 1 and argv[1].endswith(script) and str(log_dir) in argv:
            pids.append(int(entry.name))
    return sorted(pids)


def thread_ticks(pids):
    out = {}
    for pid in pids:
        threads = {}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            threads[int(task.name)] = (comm, int(fields[11]) + int(fields[12]))  # utime + stime
        out[pid] = threads
    return out


class watch_cpu:
    """Samples the ranks' threads after the warm-up epoch and after the last one, in a thread of the bench."""

    def __init__(self, proc, script, log_dir, epochs):
        self.cores = None
        self.thread = threading.Thread(target=self._run, args=(proc, script, log_dir, epochs), daemon=True)
        if Path("/proc/self/task").is_dir():
            self.thread.start()

    def _run(self, proc, script, log_dir, epochs):
        metrics, logged, before = Path(log_dir) / "metrics.jsonl", 0, None
        while proc.poll() is None:
            time.sleep(0.05)
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            if lines == logged:
                continue
            logged = lines
            if before is None and lines >= 1:
                before, t0 = thread_ticks(rank_pids(script, log_dir)), time.perf_counter()
                before = before or None  # no rank found yet: try again at the next epoch
            elif before is not None and lines >= epochs:
                self.cores = cpu_by_kind(before, thread_ticks(list(before)), time.perf_counter() - t0)
                return

    def result(self):
        if self.thread.ident:  # started (Linux): it ends with the run
            self.thread.join()
        return self.cores


def cores_fields(cpu, tag):
    """Flat keys (cores_main_2, ...), so that combine() takes their medians over rounds."""
    return {f"cores_{part}_{tag}": v for part, v in (cpu or {}).items()}
