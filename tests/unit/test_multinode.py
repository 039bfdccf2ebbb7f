"""A failed collective told from a rank's own error: the launched machines' tests are in
tests/launch/test_multinode.py."""

from __future__ import annotations

import torch.distributed

from shardtune.ranks import from_a_collective


def test_collective_failures_are_told_from_local_errors():
    """A survivor waits for the watchdog to name the dead rank only when its own error came from a collective:
    the gloo error below is the one DeepSpeed's ZeRO-3 save raised when its peer was killed mid-save."""
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48352: "
                        "Connection reset by peer.")
    assert from_a_collective(gloo)
    assert from_a_collective(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    assert not from_a_collective(ValueError("The training split has 3 rows"))
    assert not from_a_collective(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
