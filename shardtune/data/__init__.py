"""The data path: sources and their loading, chat templates, the row formats and their tokenization per method,
packing, and each optimizer step's micro-batches."""
