"""Deployment targets for a cluster YAML: `k8s` renders Kubernetes manifests (`specmesh k8s render`)."""
