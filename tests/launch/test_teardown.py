"""Every process a run starts ends on its own. A DDP-on-gloo process can deadlock at exit if the last reference
to its process group goes with the DDP Reducer: the group's destructor joins gloo's worker threads while the
main thread holds the GIL that a worker needs (shardtune.parallel.distributed.shut_down explains the order that avoids
it). Two real ranks train a few DDP steps and shut down through the trainer's teardown, round after round:
every round's ranks must exit 0 on their own within the time limit."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import ENV, REPO, free_port, kill_tree, popen

ROUNDS = 2
ROUND_TIMEOUT_S = 120
RANK_SCRIPT = """
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from shardtune.parallel.distributed import shut_down

# As the trainer's DDP: gradients as views into the all-reduce buckets, the accumulation cycle of the trainer.
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                          kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
assert accelerator.num_processes == 2, accelerator.num_processes
torch.manual_seed(accelerator.process_index)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(6):
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.randn(16, 256)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
shut_down(accelerator)
assert not torch.distributed.is_initialized()
print("rank", accelerator.process_index, "shut down", flush=True)
"""


def test_ddp_on_gloo_exits_on_its_own_every_time(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    durations = []
    for round_index in range(ROUNDS):
        port, started = free_port(), time.monotonic()
        ranks = []
        for rank in range(2):
            env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
            ranks.append(popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))
        for rank, process in enumerate(ranks):
            try:
                output, _ = process.communicate(timeout=max(1.0, ROUND_TIMEOUT_S - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                for other in ranks:
                    kill_tree(other)
                raise AssertionError(f"round {round_index}: rank {rank} did not exit within {ROUND_TIMEOUT_S}s: "
                                     "a hang at shut-down") from None
            assert process.returncode == 0 and f"rank {rank} shut down" in output, (round_index, output[-3000:])
        durations.append(time.monotonic() - started)
    print(f"{ROUNDS} rounds of 2 DDP ranks, each shut down on its own: {[f'{d:.1f}' for d in durations]} s")
