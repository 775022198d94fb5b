"""Command-line helpers that are not part of the serving path."""
