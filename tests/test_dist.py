"""course/ranks.py: rank discovery from each launcher's environment; course/dist.py: the cores a rank may use."""
import sys

import pytest

from support import ROOT

sys.path.append(str(ROOT))
from course import dist, ranks

LAUNCHER_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "HOROVOD_RANK",
                 "HOROVOD_LOCAL_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE", "PALS_RANKID", "PALS_LOCAL_RANKID",
                 "PALS_LOCAL_SIZE", "PMI_SIZE", "PMI_RANK", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "MPI_LOCALRANKID",
                 "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "ALPS_APP_PE", "LOCAL_SIZE", "COURSE_LAUNCHER",
                 "SLURM_STEP_ID"]

CASES = {
    "torchrun": ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                  "TORCHELASTIC_RUN_ID": "x"}, (5, 1, 8, 4, "torchrun")),
    "deepspeed": ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 1, 2, 2, "deepspeed")),
    "horovodrun": ({"HOROVOD_RANK": "3", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_SIZE": "4",
                    "HOROVOD_LOCAL_SIZE": "2"}, (3, 1, 4, 2, "horovodrun")),
    "polaris-pals": ({"PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PMI_SIZE": "8", "PALS_LOCAL_SIZE": "4",
                      "PMI_RANK": "6"}, (6, 2, 8, 4, "mpiexec (PALS)")),
    "mpich-hydra": ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
                    (1, 1, 2, 2, "mpiexec")),
    "open-mpi": ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, (9, 1, 16, 8, "mpirun (Open MPI)")),
    "slurm": ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)"},
              (5, 1, 8, 4, "srun")),
    # srun --mpi=pmi2 adds PMI_RANK/PMI_SIZE without a local rank: Slurm's own numbers must win (2 nodes x 1 rank)
    "slurm-pmi2": ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                    "SLURM_NTASKS_PER_NODE": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 0, 2, 1, "srun")),
    # mpiexec (Hydra) inside a Slurm job step: Hydra's numbers
    "hydra-in-slurm": ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "3",
                        "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (3, 1, 4, 2, "mpiexec")),
    "single": ({}, (0, 0, 1, 1, "python")),
}


def test_the_rank_reader_outside_the_lessons_is_the_lessons_table_with_horovodrun():
    """One reading of the ranks: course/ranks.py's LAUNCHERS is the DDP lesson's step [1] table (which every torch
    lesson repeats: tests/test_lift_out.py) with horovodrun's row."""
    import ast
    tree = ast.parse((ROOT / "DDP" / "main.py").read_text())
    (table,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "LAUNCHERS" for t in node.targets)]
    ours = dict(ranks.LAUNCHERS)
    assert ours.pop("horovodrun") == ("HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE")
    assert ours == table


@pytest.mark.parametrize("name", CASES)
def test_discover(monkeypatch, name):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    variables, expected = CASES[name]
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    env = ranks.discover()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == expected


def test_master_is_loopback_on_one_host(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    env = ranks.DistEnv(rank=1, world_size=2, local_world_size=2, launcher="mpiexec")
    assert ranks.master_address(env)[0] == "127.0.0.1"


def test_more_ranks_than_unbound_cores_is_said_once_by_local_rank_0(monkeypatch, capsys):
    monkeypatch.setattr(dist.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert dist.cores() == (8, False)
    for local_rank in (0, 1):
        dist.warn_shared_cores(ranks.DistEnv(rank=local_rank, local_rank=local_rank, world_size=16,
                                             local_world_size=16))
    assert capsys.readouterr().err.count("warning: 16 ranks on the 8 core(s) of this node") == 1
    dist.warn_shared_cores(ranks.DistEnv(world_size=8, local_world_size=8))  # one core each: silent
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # bound by the launcher
    assert dist.cores() == (3, True)
    dist.warn_shared_cores(ranks.DistEnv(world_size=16, local_world_size=16))  # bound: its own cores
    assert capsys.readouterr().err == ""


def test_srun_ranks_meet_at_the_steps_first_node(monkeypatch):
    # srun without a PMI gives every rank an MPI world of one: the address must come from Slurm itself
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "nid[001-002]")
    calls = []

    def scontrol(cmd, **kwargs):
        calls.append(cmd)
        return ranks.subprocess.CompletedProcess(cmd, 0, "nid001\nnid002\n", "")
    monkeypatch.setattr(ranks.subprocess, "run", scontrol)
    env = ranks.DistEnv(rank=1, world_size=2, local_world_size=1, launcher="srun")
    assert ranks.master_address(env)[0] == "nid001"
    assert calls == [["scontrol", "show", "hostnames", "nid[001-002]"]]


@pytest.mark.parametrize("variables,port", [
    ({}, 29500),
    ({"PBS_JOBID": "4242.sophia-pbs-01.lab.alcf.anl.gov"}, 29742),
    ({"SLURM_JOB_ID": "1017"}, 29517),
    ({"PBS_JOBID": "not-a-number"}, 29500),
])
def test_the_default_port_moves_with_the_job_number(monkeypatch, variables, port):
    """Two jobs sharing a node meet on different ports; every rank of one job computes the same."""
    for name in ("PBS_JOBID", "SLURM_JOB_ID", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert ranks.default_port() == port
