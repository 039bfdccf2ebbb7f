"""A failed collective told from a rank's own error: the launched machines' tests are in
tests/launch/test_multinode.py."""

from __future__ import annotations

import os

import torch
import torch.distributed

from shardtune.parallel.ranks import from_a_collective


def test_collective_failures_are_told_from_local_errors():
    """A survivor waits for the watchdog to name the dead rank only when its own error came from a collective:
    the gloo error below is the one DeepSpeed's ZeRO-3 save raised when its peer was killed mid-save."""
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48352: "
                        "Connection reset by peer.")
    assert from_a_collective(gloo)
    assert from_a_collective(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    assert not from_a_collective(ValueError("The training split has 3 rows"))
    assert not from_a_collective(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


SHARED_CHECK = """
import os, sys, torch.distributed as dist
from shardtune.config import ConfigError
from shardtune.parallel.ranks import check_output_dir_shared
rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    check_output_dir_shared(folder, ["machine 0 (a)", "machine 1 (b)"], patience_s=2.0)
    print("ok")
except ConfigError as error:
    print(error)
dist.destroy_process_group()
"""


def test_an_output_dir_that_is_not_shared_across_machines_is_refused(tmp_path):
    """Two real ranks over gloo, as if on two machines: one --output_dir seen by both passes (and leaves nothing
    behind); a path that is a different directory on each machine, stood for by two folders, is refused on both
    ranks alike, naming the machine that cannot see rank 0's file."""
    import subprocess
    import sys

    from tests.conftest import REPO, free_port

    shared = str(tmp_path / "shared")
    for folders in ([shared, shared], [str(tmp_path / "local0"), str(tmp_path / "local1")]):
        port = free_port()
        ranks = [subprocess.Popen([sys.executable, "-c", SHARED_CHECK, str(rank), str(port), folders[rank]],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        verdicts = [rank.communicate(timeout=120)[0].strip().splitlines()[-1] for rank in ranks]
        if folders[0] == folders[1]:
            assert verdicts == ["ok", "ok"] and os.listdir(shared) == []
        else:  # the same refusal on both ranks (each names its own path, one string on real machines)
            assert all("is not one directory on every machine: machine 1 (b) cannot read what rank 0 wrote"
                       in verdict for verdict in verdicts), verdicts
