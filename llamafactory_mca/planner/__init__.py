"""Before a run: what it needs per GPU (memory.py) and which layouts of the same global batch fit (search.py)."""
