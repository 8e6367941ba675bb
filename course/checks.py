"""Course plumbing: the checks that make bad input one line and exit 2 on every rank, before any
process group exists: paths that cannot be used, an impossible device or backend, --resume without
a checkpoint. utils/parse_args.py's types check single values; this checks what they cannot.
"""
import json
import os
import sys
import tempfile

from course import network, runfiles, seal
from course.dist import backend_problem, cores, device_problem
from course.errors import fail, record_for_torchrun
from course.failures import note_args
from course.ranks import discover
from course.runfiles import epochs_done, has_checkpoint, note_default_log_dir, note_new_folder
from utils import log, parse_args
from utils.log import checkpoint_folder


def _recorded_error(parser):
    """argparse's one line, also into torchrun's error file (its report then names it)."""
    def error(message):
        line = f"{parser.prog}: error: {message} (see {parser.prog} --help)"
        record_for_torchrun(line)
        parser.exit(2, line + "\n")
    return error


class Parser(parse_args.Parser):
    """The lessons' Parser, for scripts with flags of their own (zero/): its one line also goes into
    torchrun's error file."""

    def error(self, message):
        _recorded_error(self)(message)


def resume_check(args):
    """Before the lesson starts: a checkpoint whose bytes are not the ones written is one line, exit
    2; --resume with no checkpoint too; --resume auto with none says so (rank 0) and the lesson
    starts at epoch 1. (zero/: its own checks of the rest.)"""
    if not getattr(args, "resume", False):
        return
    log_dir = getattr(args, "log_dir", None)
    folder = checkpoint_folder(getattr(args, "checkpoint_dir", None), log_dir)
    if folder and os.path.isdir(folder):  # every file as written (course/seal.py), before any load
        seal.verify(folder)
    if not hasattr(args, "log_dir"):
        return
    if args.resume is True and not checkpoint_exists(args):
        fail(f"--resume: no checkpoint at {folder}")
    if args.resume == "auto" and not checkpoint_exists(args) and discover().rank == 0:
        print(f"--resume auto: no checkpoint in {folder}: starting at epoch 1", flush=True)


def take_log_dir(args):
    """Every rank takes --log-dir for this run (course/runfiles.py): a second run on the same folder
    is refused on every rank, naming the holder, while the first one runs."""
    if getattr(args, "log_dir", None):
        runfiles.take_log_dir(args.log_dir, discover().rank, " ".join(sys.argv))


# Not taken from the saved run: where its files are, and what this machine decides (the run's
# config.json holds the device, backend and threads each rank resolved, not the flags).
NOT_REMEMBERED = {"resume", "log_dir", "download", "device", "backend", "num_threads", "local_rank",
                  "dist_timeout", "log_all_ranks"}
FIXED = {"zero_stage"}  # what a checkpoint cannot change: its ZeRO stage decides how it is sliced


def remember_flags(args, parser, argv=None):
    """--resume continues the saved run (its config.json): every flag not given anew takes the saved
    value; rank 0 says in one line which flags came from the saved run and which given anew differ
    from it. A flag the checkpoint cannot change (FIXED), given anew with another value, is one line
    naming both, exit 2."""
    if not getattr(args, "resume", False) or not getattr(args, "log_dir", None):
        return
    try:
        with open(os.path.join(args.log_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return  # nothing saved (or --resume auto on a new folder): the flags as given
    argv = sys.argv[1:] if argv is None else argv
    tokens = {t.split("=", 1)[0] for t in argv}  # (the parser takes no abbreviations)
    names = {}  # dest -> its flag; given: the dests on this command line
    for action in reversed([a for a in parser._actions if a.option_strings]):
        names[action.dest] = action.option_strings[0]
    given = {a.dest for a in parser._actions if tokens & set(a.option_strings)}

    def show(dest, value):
        return (names[dest] if value else f"no {names[dest]}") if isinstance(value, bool) else \
            f"{names[dest]} {value}"
    kept, changed = [], []
    for dest, value in sorted(vars(args).items()):
        if dest in NOT_REMEMBERED or dest not in saved or dest not in names or saved[dest] == value:
            continue
        if dest in given and dest in FIXED:
            fail(f"{names[dest]} {value}: the checkpoint in {args.log_dir} was written with "
                 f"{names[dest]} {saved[dest]}, which a resume cannot change")
        if dest in given:
            changed.append(f"{show(dest, value)} (was {saved[dest]})")
        else:
            setattr(args, dest, saved[dest])
            kept.append(show(dest, saved[dest]))
    if (kept or changed) and discover().rank == 0:
        print(f"--resume: the saved run's flags ({os.path.join(args.log_dir, 'config.json')})"
              + (f", kept: {' '.join(kept)}" if kept else "")
              + (f"; given anew: {', '.join(changed)}" if changed else ""), flush=True)


def checkpoint_exists(args):
    return has_checkpoint(checkpoint_folder(args.checkpoint_dir, args.log_dir))


def resuming(args):
    """Whether this run continues from a checkpoint: --resume (the lesson then refuses a missing
    one), or --resume auto when there is one. --resume auto without one says so (rank 0) and starts
    at epoch 1."""
    if args.resume != "auto":
        return bool(args.resume)
    if checkpoint_exists(args):
        return True
    folder = checkpoint_folder(args.checkpoint_dir, args.log_dir)
    log.info(f"--resume auto: no checkpoint in {folder}: starting at epoch 1")
    return False


def finished_already(args):
    """True for --resume auto on a run that has done all its --epochs (a restarted job that had
    finished): rank 0 says so; the lesson then returns before touching any file."""
    if getattr(args, "resume", False) != "auto":  # (zero/ has no --resume auto)
        return False
    done = epochs_done(args.log_dir)
    if not checkpoint_exists(args) or done < args.epochs:
        return False
    if discover().rank == 0:
        print(f"--resume auto: {args.log_dir} has finished {done} of {args.epochs} epoch(s) "
              "already: nothing left to do", flush=True)
    return True


# Every flag that names a path, by what the run does with it. Checked before anything starts, so an
# unusable path is one line on every rank (naming the flag) instead of a traceback after minutes of
# set-up.
OUTPUT_DIRS = ("log_dir", "checkpoint_dir")  # created if missing
INPUT_DIRS = ("data_dir",)  # must exist (with --download: created and written)
OUTPUT_FILES = ("json",)  # zero/main.py's --json: written, its folder created if missing
INPUT_FILES = ("deepspeed_config",)  # DeepSpeed's --deepspeed_config: read


def flag_name(parser, dest):
    for action in parser._actions:
        if action.dest == dest:
            return max(action.option_strings, key=len)
    return "--" + dest.replace("_", "-")


def _nearest_existing(path):
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def folder_problem(path):
    """Why `path` cannot be a folder this run writes into, or None. It may exist (a folder we can
    write in) or not (then its nearest existing parent must be a folder we can create things in).
    Tried for real, with a temporary folder removed at once: permissions alone do not tell
    (read-only mounts, /proc, root)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return "exists and is not a folder"
    parent = full if os.path.isdir(full) else _nearest_existing(full)
    if not os.path.isdir(parent):
        return f"{parent} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=parent))
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    return None


def file_problem(path, write):
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "is a folder, not a file"
    if not write:
        return None if os.access(full, os.R_OK) else "no such file, or not readable"
    if os.path.exists(full) and not os.access(full, os.W_OK):
        return "not writable"
    return folder_problem(os.path.dirname(full))


def check_paths(parser, args):
    """Every path flag usable before anything starts: one line naming the flag, exit 2, nothing
    created."""
    values = vars(args)
    for dest, kind in ([(d, "out") for d in OUTPUT_DIRS] + [(d, "in") for d in INPUT_DIRS] +
                       [(d, "file-out") for d in OUTPUT_FILES] +
                       [(d, "file-in") for d in INPUT_FILES]):
        path = values.get(dest)
        if not isinstance(path, str):
            continue
        flag = flag_name(parser, dest)
        if kind == "in" and not getattr(args, "download", False):
            if not os.path.isdir(path):
                parser.error(f"{flag} {path}: no such directory "
                             "(add --download to fetch MNIST into it)")
            problem = None if os.access(path, os.R_OK | os.X_OK) else "not readable"
        elif kind in ("out", "in"):
            problem = folder_problem(path)
        else:
            problem = file_problem(path, write=kind == "file-out")
        if problem:
            parser.error(f"{flag} {path}: {problem}")
        if kind in ("out", "in", "file-out"):
            folder = path if kind != "file-out" else os.path.dirname(os.path.abspath(path))
            note_new_folder(folder)


def warn_threads(args):
    """--num-threads above this node's cores: allowed (it may be measured on purpose), but said
    once."""
    requested, allowed = getattr(args, "num_threads", None), cores()[0]
    if requested and requested > allowed and discover().local_rank == 0:
        sys.stderr.write(f"warning: --num-threads {requested} is more than the {allowed} core(s) "
                         "this process may use: threads will share cores\n")
        sys.stderr.flush()


def parse(parser, argv=None):
    """Parse and check every flag; bad input exits 2 with one line (argparse's) before anything
    starts.

    It changes no value and decides nothing about resuming: resuming(args) and
    finished_already(args) do."""
    parser.error = _recorded_error(parser)
    args = parser.parse_args(argv)
    check_paths(parser, args)
    if getattr(args, "log_dir", "") is None:  # the lesson names a new folder under runs/
        note_default_log_dir()
    if getattr(args, "resume", False) and args.checkpoint_dir is None and args.log_dir is None:
        parser.error("--resume needs --checkpoint-dir (or the --log-dir of the run to continue)")
    # --backend: checked here, before any process group, and for each rank's device (course/dist.py)
    backend, device = getattr(args, "backend", "auto"), getattr(args, "device", "cpu")
    if "torch" in sys.modules and (problem := backend_problem(backend, device)):
        parser.error(problem)
    if "torch" in sys.modules and (problem := device_problem(getattr(args, "device", "auto"))):
        parser.error(problem)
    network.check_interfaces()  # GLOO_SOCKET_IFNAME=eth9 on a node without eth9: one line, exit 2
    warn_threads(args)
    note_args(args)
    return args
