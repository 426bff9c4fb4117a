"""Planning the input: prefix-aware ordering inside bounded windows, work units with stable ids."""
