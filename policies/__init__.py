"""Built-in policies, one module per model family (imported lazily by
shardformer.autopolicy; each imports transformers only inside functions)."""
