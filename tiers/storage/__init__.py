"""L3 storage tier: backends that hold pages beyond one host's DRAM (see base.py)."""
