"""Unit tests of the data path (shardtune/data/): sources, formats, templates, packing, batches."""
