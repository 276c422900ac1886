"""Text in, token batches out: corpora, the tokenizer, datasets, collation and resumable samplers."""
