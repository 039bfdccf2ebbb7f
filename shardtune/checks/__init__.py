"""The start-up checks, one module per thing checked (the recipe's values and the launch, the model, NVMe, the
outputs) and the hints for a mistyped flag: each raises ConfigError before anything heavy loads."""
