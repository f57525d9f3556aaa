"""Session endpoints: list, close, offload, fork; export and import of a session."""
