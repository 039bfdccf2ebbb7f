"""How the ranks are made and meet: the Accelerator and DeepSpeed's config (distributed), the pinned host
allocator's setting, the launcher's command line and the launch a --dry_run plans, the ranks' fingerprint and
watchdog, DeepSpeed's compiled ops, and the parallel axes beyond data parallelism: the sequence split (DeepSpeed
Ulysses), context parallelism (ring attention) and tensor parallelism."""
