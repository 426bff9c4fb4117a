"""Row -> prompt: list and read the input Parquet files, check their columns, render prompts to token ids."""
