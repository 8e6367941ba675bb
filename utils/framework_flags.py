"""DeepSpeed's flags, added to utils/parse_args.py's parser (Horovod's lessons write their own)."""
import argparse


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
