"""The export: the run's model directory, a checkpoint's export, and what an export wrote loaded back."""
