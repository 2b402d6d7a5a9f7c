"""Built-in policies, one module per model family (imported lazily by
shardformer.autopolicy; each imports transformers only inside functions)."""
from shardformer._versions import check_transformers_version

check_transformers_version()  # installed transformers outside the supported range: ImportError naming both
