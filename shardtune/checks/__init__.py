"""The start-up checks, one module per thing checked (the recipe's values and the launch, the accelerate config file,
the model, NVMe, the outputs), the hints for a mistyped flag and the one-line parser of the planner's and the scripts'
command lines: each raises ConfigError before anything heavy loads."""
