"""Baselines and harness for scripts/bench_peers.py: tiercache against what a household would pick instead."""
