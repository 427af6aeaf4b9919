"""The paged KV cache's bookkeeping: layer specs and groups, the block pool, block tables, the prefix cache."""
