"""Parquet in (source), Parquet out (sink), and what the user sees while it runs (progress)."""
