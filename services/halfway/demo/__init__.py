"""Demos that run on the real broker: `halfway demo NAME`."""
