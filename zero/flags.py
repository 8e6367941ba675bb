"""The flags of zero/main.py and their checks (zero/report.py takes the same model flags and passes
them on to every launch); the checked parser of zero/fsdp_checkpoint.py too."""
import argparse

from utils import data
from utils.parse_args import Parser, non_negative_int, positive_float, positive_int


def model_flags(p):
    """The flags that decide what is trained; zero/report.py takes the same and passes them on."""
    p.add_argument("--hidden", type=positive_int, default=2560,
                   help="width of the MLP's hidden layers")
    p.add_argument("--layers", type=non_negative_int, default=4,
                   help="hidden-to-hidden layers (hidden^2 each)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="Adam steps (>= 2: its state exists after the first)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="digits per rank and step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--dist-timeout", type=positive_int, default=300,
                   help="seconds before a collective gives up")
    return p


def problems(args, ranks):
    """What zero/main.py cannot train with these flags on `ranks` ranks."""
    if args.steps < 2:
        yield "--steps must be at least 2 (Adam's state exists only after the first step)"
    if args.hidden < 16:
        yield "--hidden must be at least 16"
    if args.steps * args.batch_size * ranks > data.SHIPPED_TRAIN:
        yield (f"--steps {args.steps} x --batch-size {args.batch_size} x {ranks} ranks needs more "
               f"than the {data.SHIPPED_TRAIN:,} training digits")


class Checked(Parser):
    """A parser that also refuses what problems(args) yields: one line and exit 2 on every rank,
    before any process group exists."""

    def __init__(self, problems, **kwargs):
        super().__init__(**kwargs)
        self.problems = problems

    def parse_known_args(self, args=None, namespace=None):
        args, rest = super().parse_known_args(args, namespace)
        for problem in self.problems(args):
            self.error(problem)
        return args, rest


def parser(doc, ranks, variants):
    p = Checked(lambda args: problems(args, ranks), description=doc,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags(p).add_argument("--variant", choices=list(variants), default="ds3",
                                help="what is partitioned, by whom (default ds3)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "xpu"], default="auto",
                   help="this rank's GPU where torch sees one (auto), or cpu")
    p.add_argument("--json", help="rank 0 writes the losses and every rank's census here")
    return p
