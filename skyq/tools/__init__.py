"""Command-line tools: `python -m skyq.tools.<name>` (converters and checkpoint inspection)."""
