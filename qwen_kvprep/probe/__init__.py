"""Probes gather facts and never change anything."""
