"""Training: the demo models (demo.py), Medusa heads (medusa.py), the EAGLE head (eagle.py)."""
