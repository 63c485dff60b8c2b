"""Typed contracts shared by layers that must not import each other (see contracts/worker.py)."""
