"""Unit tests of the export (shardtune/export/) and what an export wrote."""
