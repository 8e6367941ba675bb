"""Shared helpers for the course's examples: arguments, rank discovery, data, logging, checkpoints.

The training loops themselves live in each example's main.py, so each reads top to bottom as a lesson.
"""
