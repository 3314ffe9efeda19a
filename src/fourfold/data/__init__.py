"""The corpus: sources, the tokenizer, token files and the resumable batch order."""
