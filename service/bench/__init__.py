"""`moecache bench`: decode and prefill speed, expert-cache figures and the machine's bound, swept over
cache configurations on one loaded engine."""
