"""The flags of zero/main.py that decide what is trained, and their checks: zero/report.py takes the
same flags and passes them on to every launch."""
from utils.checks import check_paths
from utils.parse_args import non_negative_int, positive_float, positive_int


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


def check(p, args):
    """Bad input: one `error:` line and exit 2 (argparse's), on every rank, before any process group
    exists."""
    if args.steps < 2:
        p.error("--steps must be at least 2 (Adam's state exists only after the first step)")
    if args.hidden < 16:
        p.error("--hidden must be at least 16")
    check_paths(p, args)  # --json: a file we can write, checked before anything starts
