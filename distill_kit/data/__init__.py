"""Text (and chat) data into micro-batches; the embedded default's corpus and tokenizer."""
