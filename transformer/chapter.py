"""What the chapter's six lessons do alike that no step of the recipe names: the run's folder, files
and text; the model's shape from the flags; the windows each epoch draws; the test windows. Each
lesson calls these in one line apiece; the recipe's steps [1]-[8] stay in the lesson, where they
differ. A copy of a lesson takes this file along (transformer/README.md)."""
import torch
import torch.distributed as dist

from transformer import model as gpt
from transformer import text
from utils import log


def open_run(framework, args, rank, local_rank):
    """This rank's lines (rank 0's, or every rank's with --log-all-ranks), the run's folder, its
    files and the text: (run, log_dir, train, test, about). Every rank writes into one folder,
    named for rank 0's clock and sent to the others (their clocks may differ by a second)."""
    log.configure(rank, local_rank, args.log_all_ranks)
    log_dir = [args.log_dir or log.default_log_dir(framework)]
    if dist.is_initialized():  # (ddp.py in one process joins no group)
        dist.broadcast_object_list(log_dir, src=0)
    run = log.RunLog(log_dir[0], rank == 0)
    barrier = dist.barrier if dist.is_initialized() else lambda: None  # rank 0 downloads first
    train, test, about = text.load(args.data_dir, args.download, rank == 0, barrier=barrier)
    return run, log_dir[0], train, test, about


def model_config(args, **more):
    """The GPT's shape and seed from the flags (model.py's Config); `more`: a lesson's own."""
    return gpt.Config(context=args.context, layers=args.layers, heads=args.heads,
                      width=args.width, dropout=args.dropout, seed=args.seed, **more)


def draw_starts(train, args, epoch, steps, n):
    """The epoch's windows: [steps, n] start positions in the training text, the same on every rank
    (drawn from --seed and the epoch), so that each rank can take its own columns ([3])."""
    draw = torch.Generator().manual_seed(args.seed * 1000 + epoch)
    return torch.randint(len(train) - args.context - 1, (steps, n), generator=draw)


def test_starts(test, context, multiple=1):
    """The test windows' starts, the same every epoch: at most text.TEST_WINDOWS, cut to a multiple
    of `multiple` (as many windows for each rank, or whole micro-batches)."""
    starts = torch.arange(0, len(test) - context - 1, context)[:text.TEST_WINDOWS]
    return starts[:len(starts) // multiple * multiple]
