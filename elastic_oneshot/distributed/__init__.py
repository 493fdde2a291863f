"""Distributed plumbing: the process group, etcd client and rendezvous, signals."""
