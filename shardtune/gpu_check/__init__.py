"""What `make gpu-check` runs on a GPU: its cases' processes and the figures it compares."""
