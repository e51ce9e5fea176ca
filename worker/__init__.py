"""Pluggable workers; ours is a torch + triton serving runtime (decide / execute split)."""
