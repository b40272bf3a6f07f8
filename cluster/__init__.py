"""Cluster: Ray placement, worker registry, and the `pdserve` command line."""
