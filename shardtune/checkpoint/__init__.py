"""Durable, sharded training checkpoints through accelerate's state saving, optionally written in the background,
and finding one to resume from.

A checkpoint is written by every rank into `output_dir/.checkpoint-<step>.tmp`. Every rank then fsyncs each file
and directory of it, so that what it wrote is on disk and not only in its machine's page cache; only after that
(a collective) does rank 0 rename it to `output_dir/checkpoint-<step>`, fsync `output_dir` so that the rename
survives a power cut, and write `checkpoint_complete.json`, which lists every file with its size (and a checksum
for the small ones). Older checkpoints are deleted after that. A crash at any moment therefore leaves the
previous complete checkpoint as the newest, and a checkpoint whose files were lost or cut short after all (a
disk that lied, a file deleted by hand) is detected against its marker and skipped by `auto`.

With `--async_save true` a save copies the state to host memory (rank by rank, each its own shard) and returns;
a background thread writes and fsyncs the files while training goes on, and the marker is written at the first
step boundary after every rank's write is durable. One save is in flight at a time: a new save, a stop signal and
the end of training first wait for it.

Modules: `saver` (the Checkpointer: when to save, and a save from start to marker), `staging` (each strategy's
state copied or written, one function per strategy), `markers` (completion markers and the resume lookup; the
standard library only, so that the command line resolves a resume before torch loads), `durable` (fsync),
`tensor_files` (torch and safetensors files, streamed), `pending` (a save in flight), `mmap_load` (DeepSpeed's
checkpoint loads memory-mapped), `nvme_resume` (the resume's load_state, and what DeepSpeed's load leaves out
when the optimizer is on NVMe), `universal` (a ZeRO checkpoint converted to DeepSpeed's universal form for a resume
on another number of processes, into the resuming run's output directory), `conversion_plan` (that conversion's
host RAM and time, planned before it starts, and its peak measured), `run_settings` (what a checkpoint was trained
with, and whether a resume, on this or another number of processes, trains the same run), `output_dir` (the lock
that makes an output directory one live run's), `run_files` (what a run writes there, and deleting only that),
`preemption` (a stop signal: save, then exit 75).
"""
