"""Other libraries' private names and internals that AdaptiveBatch reads, sets or overrides, one module per library:
when a release renames one, its library's module is the one to change. Each touch says why no public channel serves."""
