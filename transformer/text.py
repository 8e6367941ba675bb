"""The chapter's text, its flags and their checks. Bytes are the tokens (vocabulary 256). Text:
1. --data-dir DIR with input.txt; 2. --download: rank 0 fetches Tiny Shakespeare (1.1 MB, the
char-rnn corpus) into --data-dir (default data/), the others wait; 3. else Python's own standard
library sources (the top-level Lib/*.py, sorted: always there, no network). 90% trains, 10%
tests."""
import sysconfig
import urllib.request
from pathlib import Path

import torch

from utils import parse_args
from utils.data import DataError
from utils.parse_args import get_parser, positive_float, positive_int

SHAKESPEARE = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
               "input.txt")
TEST_WINDOWS = 256  # the test set: at most this many windows of the test split, the same each epoch


def load(data_dir=None, download=False, is_main=True, barrier=lambda: None):
    """(train, test) byte tensors and a line that says what they are."""
    if download:
        path = Path(data_dir or "data") / "input.txt"
        if is_main and not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                urllib.request.urlretrieve(SHAKESPEARE, path.with_suffix(".part"))
                path.with_suffix(".part").rename(path)  # whole, or not there
            except OSError as exc:
                raise DataError(f"download of {SHAKESPEARE} into {path.parent} failed: {exc}")
        barrier()  # the other ranks wait for rank 0's download
        data_dir = path.parent
    if data_dir is not None:
        path = Path(data_dir) / "input.txt"
        if not path.is_file():
            raise DataError(f"no input.txt in {data_dir}: add --download (Tiny Shakespeare), or "
                            "leave out --data-dir (Python's standard library sources)")
        raw, what = path.read_bytes(), str(path)
    else:
        lib = Path(sysconfig.get_paths()["stdlib"])
        raw = b"\n".join(f.read_bytes() for f in sorted(lib.glob("*.py")))
        what = f"Python's standard library sources ({lib}/*.py)"
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    cut = len(tokens) * 9 // 10
    train, test = tokens[:cut], tokens[cut:]
    return train, test, f"{what}: {len(train):,} train / {len(test):,} test bytes (tokens)"


def windows(tokens, starts, context):
    """Inputs and targets: `context` bytes from each start, and the same shifted by one."""
    rows = torch.stack([tokens[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def parser(doc, lesson, ranks=1, schedules=None):
    """The course's flags, with the chapter's defaults, + the model's sizes, + the lesson's own
    (ddp, fsdp, tp, cp, ep, pp), checked on parsing against the `ranks` the launcher started.
    schedules (pp.py): {name: stages each rank holds}."""
    p = get_parser(doc, cls=lambda **kwargs: Parser(lesson, ranks, schedules, **kwargs))
    for action in p._actions:  # (the same flag, this chapter's data)
        if action.dest == "data_dir":
            action.help = "folder with input.txt; default: Python's standard library sources"
        if action.dest == "download":
            action.help = "download Tiny Shakespeare into --data-dir (rank 0)"
    p.set_defaults(epochs=1, max_steps=200, batch_size=16, test_batch_size=32, lr=3e-3,
                   dropout=0.0, log_interval=20, momentum=None)
    flag = p.add_argument_group("model").add_argument
    flag("--context", type=positive_int, default=128, help="tokens per sequence")
    flag("--layers", type=positive_int, default=6, help="transformer blocks")
    flag("--heads", type=positive_int, default=4, help="attention heads per block")
    flag("--width", type=positive_int, default=128, help="embedding size (the MLP: 4x)")
    if lesson in ("ddp", "fsdp"):
        flag = p.add_argument_group("memory against time").add_argument
        flag("--activation-checkpointing", action="store_true", help="keep only each block's "
             "input for backward and compute the block again there: less memory, about 1/3 "
             "more compute")
        flag("--bf16", action="store_true", help="mixed precision: compute in bf16, keep weights "
             "and optimizer in fp32 (ddp.py: torch.autocast; fsdp.py: MixedPrecisionPolicy, "
             "gradients reduced in fp32)")
    flag = p.add_argument_group("parallelism").add_argument
    if lesson == "fsdp":
        flag("--replicate", type=positive_int, default=1, help="HSDP: this many copies of the "
             "model, each sharded over world size / replicate ranks (1: FSDP, one shard group)")
    if lesson == "ddp":
        flag("--compile", action="store_true", help="torch.compile the (DDP-wrapped) model: "
             "compiling costs the first step, fused kernels may speed up the rest")
    if lesson == "pp":
        flag("--schedule", choices=sorted(schedules), default="1f1b", help="pipeline schedule")
        flag("--micro-batches", type=positive_int, default=4, help="micro-batches per batch")
    if lesson == "ep":
        flag("--experts", type=positive_int, default=4, help="experts in each block's MoE, "
             "spread evenly over the ranks")
        flag("--top-k", type=positive_int, default=2, help="experts each token is sent to")
        flag("--capacity-factor", type=positive_float, default=1.25, help="an expert takes at "
             "most this x top-k x context / experts tokens of a sequence; the rest are dropped")
    if lesson == "tp":
        flag("--dp", type=positive_int, default=1, help="data-parallel ranks: the ranks form a "
             "dp x tp mesh, tp = world size / dp; dp > 1 shards with FSDP2")
    return p


class Parser(parse_args.Parser):
    def __init__(self, lesson, ranks, schedules, **kwargs):
        super().__init__(**kwargs)
        self.lesson, self.ranks, self.schedules = lesson, ranks, schedules

    def parse_known_args(self, args=None, namespace=None):
        args, rest = super().parse_known_args(args, namespace)
        for problem in problems(args, self.lesson, self.ranks, self.schedules):
            self.error(problem)  # one line, exit 2
        return args, rest


def shortest_text(context, ranks):
    """The fewest bytes of input.txt that load() splits into a train part with a window of
    `context` + 1 bytes to draw and a test part with at least one window for each rank."""
    size = 10 * (ranks * context + 2) - 10
    while True:
        cut = size * 9 // 10
        test = size - cut
        if cut - context - 1 >= 1 and len(range(0, test - context - 1, context)) >= ranks:
            return size
        size += 1


def problems(args, lesson, ranks=1, schedules=None):
    """What the chapter's lesson cannot do with these flags on `ranks` ranks."""
    given = Path(args.data_dir or "data") / "input.txt" if args.data_dir or args.download else None
    if given and given.is_file() and given.stat().st_size < shortest_text(args.context, ranks):
        yield (f"{given} has {given.stat().st_size:,} bytes: --context {args.context} on {ranks} "
               f"rank(s) needs at least {shortest_text(args.context, ranks):,} (90% trains: a "
               f"window of {args.context + 1} bytes; 10% tests: a window for each rank)")
    if lesson == "fsdp" and ranks % args.replicate:
        yield f"--replicate {args.replicate} does not divide the {ranks} rank(s) into copies"
    if (getattr(args, "bf16", False) and args.device in ("auto", "cuda")
            and torch.cuda.is_available() and not torch.cuda.is_bf16_supported()):  # (CPUs: any)
        yield f"--bf16: {torch.cuda.get_device_name()} has no bfloat16 arithmetic (--device cpu)"
    if args.momentum is not None:
        yield "--momentum: the transformer trains with AdamW (betas 0.9, 0.95), not SGD"
    if args.grad_accum != 1 or args.lr_warmup_epochs:
        yield "--grad-accum/--lr-warmup-epochs: not in the transformer lessons"
    if args.width % args.heads:
        yield f"--heads {args.heads} does not divide --width {args.width}"
    split = ranks // args.dp if hasattr(args, "dp") else ranks  # (tp.py: ranks = dp x tp)
    if hasattr(args, "dp") and ranks % args.dp:
        yield f"--dp {args.dp} does not divide the {ranks} rank(s) into dp x {lesson}"
    elif lesson == "tp" and args.heads % split:
        yield (f"--heads {args.heads}: {split} tensor-parallel ranks need a multiple of {split} "
               "(each rank computes whole heads)")
    elif lesson in ("tp", "cp") and args.context % split:
        yield (f"--context {args.context} does not divide into {split} equal parts of the "
               f"sequence, one per {lesson} rank")
    stages = ranks * schedules[args.schedule] if lesson == "pp" and ranks > 1 else 1
    if lesson == "pp" and args.layers % stages:
        yield (f"--layers {args.layers} do not divide into {stages} equal stages ({ranks} rank(s)"
               f" x {schedules[args.schedule]} stage(s) each for --schedule {args.schedule})")
    if lesson == "pp" and args.batch_size % args.micro_batches:
        yield (f"--micro-batches {args.micro_batches} does not divide --batch-size "
               f"{args.batch_size} into equal micro-batches")
    if lesson == "pp" and args.schedule == "1f1b" and args.micro_batches < stages:
        yield (f"--schedule 1f1b needs at least one micro-batch per stage: --micro-batches "
               f"{args.micro_batches} < {stages} stages")
    if lesson == "ep" and args.experts % ranks:
        yield (f"--experts {args.experts} does not divide over {ranks} expert-parallel ranks "
               "(each holds as many)")
    if lesson == "ep" and args.top_k > args.experts:
        yield f"--top-k {args.top_k}: more than the {args.experts} experts (--experts)"
    if lesson not in ("ddp", "fsdp") and (args.resume or args.checkpoint_dir):
        yield ("--resume/--checkpoint-dir: this lesson keeps no checkpoints (fsdp.py shows DCP, "
               "which saves DTensors of any layout); --save-model writes the final weights")
    if lesson not in ("ddp", "fsdp") and args.dropout:
        yield "--dropout: the model-splitting lessons train without it (equal to one process)"
