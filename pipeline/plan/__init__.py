"""Planning: prefix-aware ordering of the input and the roofline arithmetic for a job."""
