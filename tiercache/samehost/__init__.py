"""The same-host protocol: the slab's layout and seqlock (slab.py), the shared index (index.py), the
readers of both (reader.py) and the disk tier's files as readers see them (disk_files.py). The daemon's
tiers write through it and same-host clients read through it."""
