"""Output: Parquet parts committed in units, the ledger and lease that make a run resumable, signals, verify."""
