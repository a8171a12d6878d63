"""Other libraries' private names and internals AdaptiveBatch touches, one module per library, each saying why."""
