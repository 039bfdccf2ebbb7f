"""Unit tests of the start-up checks (shardtune/checks/) and the flag hints."""
