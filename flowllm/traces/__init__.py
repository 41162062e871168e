"""Recorded traces: record channel traffic, replay it into one stage, view a timeline.

See traces/README.md at the repository root for the file format.
"""
