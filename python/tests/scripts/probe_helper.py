"""Imported by launch_probe.py from its own directory."""

NAME = "probe_helper"
