"""The data path: sources and formats, chat templates, tokenization, packing, and each optimizer step's
micro-batches."""
