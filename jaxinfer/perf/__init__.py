"""Measurement: per-request metrics, the roofline of each chip, the capacity planner."""
