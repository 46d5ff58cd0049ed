"""The coordinator: round engine, strategies (round scripts), transports, summaries."""
