"""Numbers: roofline arithmetic, the machine probe, progress display and the run report."""
