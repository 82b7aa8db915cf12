"""Shared gRPC plumbing of the specmesh services: server bootstrap, errors, sessions, metrics, options.

Kept out of `specmesh/` on purpose: the library never imports grpc.
"""
