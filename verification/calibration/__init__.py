"""Calibration of the verification thresholds on honest variation (script + committed data)."""
