"""Rendezvous backends for torchrun. `etcd_v3` registers `--rdzv-backend=etcd3` (entry point in pyproject.toml)."""
