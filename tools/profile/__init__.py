"""`specrt profile`: measurements (measure.py), the analysis (advice.py), tables and plots (report.py)."""
